"""taskloop: durable, bounded loop tasks and workflows on Celery + Redis."""

from taskloop.client import CancelResult, RunHandle, TaskLoop
from taskloop.context import LoopContext, Signal, TaskContext
from taskloop.definitions import Task, Workflow, define_gate, define_loop_task, define_task, define_workflow
from taskloop.errors import (
    Cancelled,
    DefinitionError,
    GateRefused,
    IncompatibleDefinition,
    InvalidInput,
    InvalidOutput,
    LoopTaskExhausted,
    RunNotFound,
    RunTimeout,
    StoreUnavailable,
    TaskFailed,
    TaskLoopError,
    TaskTimeout,
    WorkflowBudgetExceeded,
)
from taskloop.events import Event
from taskloop.models import ErrorInfo, RoundView, RunResult, RunView, TaskView
from taskloop.options import Budget, Cache, LoopCheck, Retry

__all__ = [
    "Budget",
    "Cache",
    "CancelResult",
    "Cancelled",
    "DefinitionError",
    "ErrorInfo",
    "Event",
    "GateRefused",
    "IncompatibleDefinition",
    "InvalidInput",
    "InvalidOutput",
    "LoopCheck",
    "LoopContext",
    "LoopTaskExhausted",
    "Retry",
    "RoundView",
    "RunHandle",
    "RunNotFound",
    "RunResult",
    "RunTimeout",
    "RunView",
    "Signal",
    "StoreUnavailable",
    "Task",
    "TaskContext",
    "TaskFailed",
    "TaskLoop",
    "TaskLoopError",
    "TaskTimeout",
    "TaskView",
    "Workflow",
    "WorkflowBudgetExceeded",
    "define_gate",
    "define_loop_task",
    "define_task",
    "define_workflow",
]
