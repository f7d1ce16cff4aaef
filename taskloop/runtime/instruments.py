"""The hooks of this process (taskloop/ops/hooks.py), registered in one place: what each point of
a run tells, and to whom. The core paths call ``hooks()`` and one method of it at each point.

- Prometheus metrics (ops/metrics.py ``MetricsHook``), where they are exported
  (``TASKLOOP_METRICS=1``, set by ``taskloop worker --metrics-port``);
- OpenTelemetry tracing (ops/otel.py ``TracingHook``), where it is on (ops/tracing.py: the
  ``OTEL_*`` variables, or the application's own TracerProvider; off, opentelemetry is not
  imported);
- the workflows' observers (runtime/observing.py ``ObserverHook``), always.

- the hooks an application adds (``add_hook``, ``tl.add_hook``: an exporter of its own).

Another of taskloop's concerns is a ``Hook`` added to ``registered`` (docs/architecture.md,
*Adding instrumentation*).
"""

from __future__ import annotations

import sys
import time

from taskloop.base.errors import DefinitionError
from taskloop.ops import metrics, tracing
from taskloop.ops.hooks import Hook, Hooks
from taskloop.runtime.observing import ObserverHook

_hooks: Hooks | None = None
_traced = False  # tracing was on when the hooks were registered
_looked = 0.0  # when hooks() last looked for a TracerProvider the application set since
_added: list[Hook] = []


def registered() -> list[Hook]:
    """This process's hooks, in the order each point calls them."""
    global _traced
    found: list[Hook] = []
    if metrics.enabled():
        found.append(metrics.MetricsHook())
    traced = tracing.hook()
    _traced = traced is not None
    if traced is not None:
        found.append(traced)
    found.append(ObserverHook())
    return [*found, *_added]


def add_hook(hook: Hook) -> None:
    """Add an application's hook to this process's (``tl.add_hook``). Call it where the workflows
    are defined, at import: a worker imports them before it starts its pool processes, which
    inherit it."""
    if not isinstance(hook, Hook):
        raise DefinitionError(f"add_hook: hook must be an instance of a subclass of taskloop.Hook that overrides "
                              f"the points it needs (e.g. phase_ended), got {type(hook).__name__}")
    _added.append(hook)
    reset()


def hooks() -> Hooks:
    """The dispatcher of this process's hooks (made on first use, and again once the application
    sets a TracerProvider of its own after it)."""
    global _hooks, _looked
    if _hooks is None:
        _hooks = Hooks(registered())
    elif not _traced and "opentelemetry.trace" in sys.modules and time.monotonic() - _looked >= 1.0:
        _looked = time.monotonic()  # (redis-py imports opentelemetry by itself: look at most once a second)
        if tracing.app_provider_set():
            _hooks = Hooks(registered())
    return _hooks


def reset(added: bool = False) -> None:
    """Register the hooks again on next use (a test that changes what is on; ``added``: and drop
    the hooks ``add_hook`` added)."""
    global _hooks
    _hooks = None
    if added:
        _added.clear()
