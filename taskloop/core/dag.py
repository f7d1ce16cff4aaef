"""The topology of a workflow of tasks linked by ``after`` (a DAG): a new run writes every record
and activates the roots; a task that ends settles its dependents along the edges. A finished
task lowers its dependents' ``waiting_on`` and activates those that reach zero; a task that ended
otherwise skips them (or, in a stopped or cancelled run, ends them by the run's control)."""

from __future__ import annotations

import json

from taskloop.core import fields as fld
from taskloop.core.begin import initial_record
from taskloop.core.phases import EventKind, PhaseEvent
from taskloop.core.plan import Plan
from taskloop.core.records import TaskRecord
from taskloop.core.states import State, TaskStatus


class Dag:
    def start(self, plan: Plan) -> None:
        workflow = plan.workflow
        for task in workflow.tasks:
            plan.tasks[task.key] = plan.changed[task.key] = initial_record(task)
        plan.counters[fld.F_OPEN] = len(workflow.tasks)
        if workflow.gates:
            plan.run_updates[fld.F_GATES] = json.dumps(list(workflow.gates))
        for key in workflow.roots:
            plan.activate(key)

    def record_keys(self, plan: Plan) -> list[str]:
        return list(plan.workflow.order)

    def settle(self, plan: Plan, record: TaskRecord) -> None:
        if record.status is TaskStatus.FAILED:
            plan.note_failure(record)
        for dependent in plan.workflow.dependents.get(record.key, ()):
            if plan.record(dependent).state is not State.WAITING:
                continue
            if record.status is TaskStatus.DONE:
                if plan.move(dependent, PhaseEvent(EventKind.DEP_DONE, plan.now)).waiting_on == 0:
                    plan.activate(dependent)
            elif plan.control is not None:
                plan.end_by_control(dependent)
            else:
                plan.move(dependent, PhaseEvent(EventKind.SKIP, plan.now, reason="dependency"))


DAG = Dag()
