"""taskloop's fixes to Celery and kombu (taskloop/celery_fixes/): each through an extension point,
each failing with the library's own class, each with a probe, and none a patch.

For every fix: the cause is there with the library's class (the test fails if the fix is turned
off, i.e. the library's class used) and gone with taskloop's; the app names taskloop's classes;
importing the worker patches nothing. The end-to-end tests of the same fixes: test_kombu_fix.py
and test_pool_fix.py (tests/faults), test_worker_shims.py and the fuzzed messages
(tests/fuzz/test_fuzz_messages.py)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
from celery.concurrency import prefork
from celery.concurrency.asynpool import AsynPool as CeleryAsynPool
from kombu import Producer
from kombu.connection import Connection
from kombu.transport import redis as kredis

from taskloop import celery_fixes
from taskloop.base.errors import OutboxUnsupported
from taskloop.celery_fixes import connection, consumer, outbox, pool, transport


def test_the_detached_transport_crash_is_kombus_and_not_taskloops() -> None:
    assert transport.detached_transport_crashes(kredis.Channel)
    assert not transport.detached_transport_crashes(transport.Channel)
    assert not transport.detached_transport_crashes(transport.SentinelChannel)


def test_a_new_client_per_batch_is_kombus_and_not_taskloops() -> None:
    assert transport.new_client_per_batch(kredis.Channel)
    assert not transport.new_client_per_batch(transport.Channel)


def test_a_stale_exit_event_untracks_a_live_process_in_celerys_pool_only() -> None:
    assert pool.untracks_a_live_process(CeleryAsynPool)
    assert not pool.untracks_a_live_process(pool.AsynPool)
    assert pool.TaskPool.Pool is pool.AsynPool and issubclass(pool.TaskPool, prefork.TaskPool)


def test_a_scalar_body_stops_celerys_strategy() -> None:
    assert consumer.scalar_body_raises()  # the cause that taskloop's consumer catches (its test: fuzz messages)


def test_reconnects_are_slow_in_celery_and_fast_in_taskloops_connection() -> None:
    assert connection.slow_reconnects()
    seen: list[float] = []

    class Probe(connection.BrokerConnection):
        def _ensure_connection(self, errback=None, max_retries=None, interval_start=2, interval_step=2,  # type: ignore[no-untyped-def]
                               interval_max=30, **kwargs):
            seen.append(interval_max)

    Probe("memory://").ensure_connection()  # as Celery's consumer calls it: no intervals
    seen_plain: list[float] = []

    class Plain(Connection):
        def _ensure_connection(self, errback=None, max_retries=None, interval_start=2, interval_step=2,  # type: ignore[no-untyped-def]
                               interval_max=30, **kwargs):
            seen_plain.append(interval_max)

    Plain("memory://").ensure_connection()
    assert seen == [connection.RECONNECT_MAX_S] and seen_plain == [30]


def test_the_app_names_taskloops_classes_and_importing_the_worker_patches_nothing() -> None:
    before = (kredis.Channel._connparams, kredis.Channel.conn_or_acquire, CeleryAsynPool._event_process_exit,
              prefork.TaskPool.Pool)
    from taskloop.worker.app import app

    assert app.conf.broker_transport == transport.TRANSPORT
    assert app.conf.worker_pool == pool.POOL
    assert app.conf.worker_consumer == "taskloop.worker.consumer:Consumer"
    assert app.amqp_cls is connection.AMQP or app.amqp.__class__ is connection.AMQP
    assert (kredis.Channel._connparams, kredis.Channel.conn_or_acquire, CeleryAsynPool._event_process_exit,
            prefork.TaskPool.Pool) == before


def test_every_probe_answers_and_unchecked_versions_are_named(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    found = celery_fixes.probe_all()
    assert len(found) == 5 and all(isinstance(v, bool) for v in found.values())
    assert celery_fixes.unchecked_versions() == []  # the versions this tree pins are the checked ones
    real = importlib.metadata.version
    monkeypatch.setattr(celery_fixes, "version", lambda name: "9.9.9" if name == "kombu" else real(name))
    assert celery_fixes.unchecked_versions() == ["kombu 9.9.9 (the fixes were checked against 5.7.0)"]
    from taskloop.worker.app import say_unchecked_versions

    with caplog.at_level(logging.WARNING, "taskloop.worker"):
        say_unchecked_versions()
    assert "not checked against kombu 9.9.9" in caplog.text


class _PublishesAtOnce(transport.Channel):
    """taskloop's channel on a kombu whose Redis channel ran a batched publish's commands itself."""

    def _put(self, queue, message, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.pop("_publish_batch", None)
        return super()._put(queue, message, **kwargs)


def test_the_outbox_collects_through_taskloops_channel_class_and_checks_kombu_first() -> None:
    """The outbox's commands come through taskloop's channel class (celery_fixes/outbox.py), not an
    attribute set on a live channel; on a kombu that would run them instead, collect refuses."""
    assert outbox.hands_over_commands(transport.Channel) and outbox.hands_over_commands(transport.SentinelChannel)
    assert not outbox.hands_over_commands(kredis.Channel)  # kombu's own channel keeps nothing
    assert not outbox.hands_over_commands(_PublishesAtOnce)
    assert celery_fixes.relied_on() == outbox.probe(transport.Channel) and all(celery_fixes.relied_on().values())
    before = kredis.Channel.create_publish_batch
    channel = outbox.offline_channel(transport.Channel)
    producer = Producer(channel, auto_declare=False)
    patched: list[bool] = []

    def publish() -> None:
        patched.append("create_publish_batch" in vars(channel))
        producer.publish({"x": 1}, routing_key="q", serializer="json")

    assert [(name, args[0]) for name, args in outbox.collect(producer, publish)] == [("lpush", "q")]
    assert patched == [False] and "create_publish_batch" not in vars(channel)
    assert kredis.Channel.create_publish_batch is before and channel._taskloop_outbox is None
    for refused, why in ((kredis.Channel, "publishes immediately"), (_PublishesAtOnce, "no longer hands")):
        with pytest.raises(OutboxUnsupported, match=why):
            outbox.collect(Producer(outbox.offline_channel(refused), auto_declare=False), lambda: None)


def test_a_worker_says_at_start_when_what_the_outbox_relies_on_no_longer_holds(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import taskloop.worker.app as worker_app

    with caplog.at_level(logging.WARNING, "taskloop.worker"):
        worker_app.say_what_no_longer_holds()
        assert "no longer holds" not in caplog.text
        monkeypatch.setattr(worker_app, "relied_on", lambda: outbox.probe(_PublishesAtOnce))
        worker_app.say_what_no_longer_holds()
    assert "no longer holds with the installed libraries: kombu's publish batch hands" in caplog.text
