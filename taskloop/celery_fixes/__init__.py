"""taskloop's fixes to Celery, kombu and billiard, each through the extension point the library
offers, never by patching its internals:

================================  ==========================================  ==========================
fix                               extension point                             module
================================  ==========================================  ==========================
a detached transport crashed the  kombu transport subclass, Celery's          transport.py
worker when Redis restarted       ``broker_transport`` setting
a new redis client per message    (the same transport subclass)               transport.py
two pool processes dying together Celery's ``worker_pool`` setting (a         pool.py
stopped the worker                prefork TaskPool on an AsynPool subclass)
a scalar message body stopped     Celery's ``worker_consumer`` setting        consumer.py
the worker
reconnects up to 30 s apart       the app's ``amqp`` class (its Connection)   connection.py
================================  ==========================================  ==========================

One extension is here too, not a fix: the outbox's messages handed over as Redis commands instead
of published (outbox.py, on the same transport subclass; ``relied_on()`` says whether kombu still
does what it relies on).

Each was checked against the versions in CHECKED, has a test in the default CI run that fails
with the library's own class instead (tests/unit/test_celery_fixes.py and the tests it names),
and a probe that says whether the installed library still has the cause (``probe_all()``,
``python -m taskloop.celery_fixes``). The upstream reports are in docs/upstream.md. A worker on a
version not in CHECKED says so when it starts (``unchecked_versions``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

CHECKED: dict[str, tuple[str, ...]] = {
    "celery": ("5.7.0",),
    "kombu": ("5.7.0",),
    "billiard": ("4.3.2",),
    "redis": ("8.1.0",),
}


def unchecked_versions() -> list[str]:
    """The installed libraries whose version the fixes were not checked against."""
    found = []
    for name, checked in CHECKED.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            continue
        if installed not in checked:
            found.append(f"{name} {installed} (the fixes were checked against {', '.join(checked)})")
    return found


def probe_all() -> dict[str, bool]:
    """For every fix: is its cause still in the installed library (True: the fix is still needed)?"""
    from taskloop.celery_fixes import connection, consumer, pool, transport

    return {**transport.probe(), **pool.probe(), **consumer.probe(), **connection.probe()}


def relied_on() -> dict[str, bool]:
    """For every extension: does the installed library still do what it relies on (True: it does)?"""
    from taskloop.celery_fixes import outbox, transport

    return outbox.probe(transport.Channel)
