"""The hooks of this process (taskloop/ops/hooks.py), registered in one place: what each point of
a run tells, and to whom. The core paths call ``hooks()`` and one method of it at each point.

- Prometheus metrics (ops/metrics.py ``MetricsHook``), where they are exported
  (``TASKLOOP_METRICS=1``, set by ``taskloop worker --metrics-port``);
- the workflows' observers (runtime/observing.py ``ObserverHook``), always.

- the hooks an application adds (``add_hook``, ``tl.add_hook``: an exporter of its own).

Another of taskloop's concerns is a ``Hook`` added to ``registered`` (docs/architecture.md,
*Adding instrumentation*).
"""

from __future__ import annotations

from taskloop.base.errors import DefinitionError
from taskloop.ops import metrics
from taskloop.ops.hooks import Hook, Hooks
from taskloop.runtime.observing import ObserverHook

_hooks: Hooks | None = None
_added: list[Hook] = []


def registered() -> list[Hook]:
    """This process's hooks, in the order each point calls them."""
    found: list[Hook] = []
    if metrics.enabled():
        found.append(metrics.MetricsHook())
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
    """The dispatcher of this process's hooks (made on first use)."""
    global _hooks
    if _hooks is None:
        _hooks = Hooks(registered())
    return _hooks


def reset(added: bool = False) -> None:
    """Register the hooks again on next use (a test that changes what is on; ``added``: and drop
    the hooks ``add_hook`` added)."""
    global _hooks
    _hooks = None
    if added:
        _added.clear()
