"""The workflows' observers (``observers=[...]``) as a hook: each is called with each event of a
write of its workflow's runs, in the process that wrote it; one that raises is recorded in the
run (an ``observer.error`` event and a counter: ``result.observer_errors``), never raised."""

from __future__ import annotations

from taskloop.base import clock
from taskloop.core import events as ev
from taskloop.core import fields as fld
from taskloop.core.batch import Batch
from taskloop.core.events import Event, notify
from taskloop.ops.hooks import Committed, Hook
from taskloop.runtime.writes import write


class ObserverHook(Hook):
    def committed(self, write_: Committed) -> None:
        workflow, run_id = write_.workflow, write_.run_id
        if not workflow.observers or not write_.events:
            return
        failures = notify(workflow.observers, [e.model_copy(update={"run_id": run_id}) for e in write_.events])
        if failures:
            batch = Batch(run_id).exists(fld.F_WORKFLOW, "run exists").expect(fld.F_COMPACT, None, "not compacted")
            for failure in failures:
                batch.event(Event(type=ev.OBSERVER_ERROR, at=clock.now(), data=failure))
            batch.incr(fld.stat_field("observer_errors"), len(failures))
            write(write_.store, batch)
