"""taskloop: durable, bounded loop tasks and workflows on Celery + Redis.

The public API is what ``__all__`` lists: the declarations, the client, what the client returns
(results, views, events) and every error a user can receive. Everything else is internal.

The errors are imported at once (they are small); every other name is imported on first use
(``__getattr__``), so that a process that needs little of taskloop, such as the supervisor of
``taskloop worker``, does not load Celery, kombu and redis-py for nothing."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from taskloop.base.errors import (
    ActionTimeout,
    Cancelled,
    CommitConflict,
    ConnectionConfigError,
    CorruptRecord,
    DefinitionError,
    GateRefused,
    GraphLimitReached,
    GraphRunFailed,
    IncompatibleDefinition,
    InvalidCacheKey,
    InvalidCheckResult,
    InvalidInput,
    InvalidOutput,
    LLMCallFailed,
    LLMNotConfigured,
    LoopIterationError,
    LoopTaskExhausted,
    NotForkable,
    NotResumable,
    OutputTooLarge,
    PhaseAbandoned,
    RunExists,
    RunNotFound,
    RunRejected,
    RunTimeout,
    StoreAccessDenied,
    StoreUnavailable,
    TaskFailed,
    TaskLoopError,
    TaskTimeout,
    WorkflowBudgetExceeded,
    WorkflowNotRegistered,
)

if TYPE_CHECKING:
    from taskloop.core.events import Event
    from taskloop.core.streamed import StreamChunk
    from taskloop.define.context import LoopContext, Signal, TaskContext
    from taskloop.define.flow import llm_check, llm_score, loop
    from taskloop.define.graph import define_graph_workflow, step
    from taskloop.define.graph_spec import Activation, Transition, TransitionHandler
    from taskloop.define.limits import Concurrency, RateLimit
    from taskloop.define.options import Budget, Cache, LoopCheck, Plateau, Retry
    from taskloop.define.tasks import Task, define_gate, define_loop_task, define_task
    from taskloop.define.workflow import Workflow, define_workflow
    from taskloop.ops.hooks import Hook, PhaseBegan, PhaseEnded, RunEnded
    from taskloop.runtime.client import CancelResult, RunHandle, TaskLoop
    from taskloop.runtime.instruments import add_hook
    from taskloop.runtime.models import (
        ErrorInfo,
        ExecView,
        RoundView,
        RunResult,
        RunSummary,
        RunView,
        TaskView,
        ThrottleView,
    )

_LAZY = {
    "Activation": "taskloop.define.graph_spec",
    "Budget": "taskloop.define.options",
    "Cache": "taskloop.define.options",
    "CancelResult": "taskloop.runtime.client",
    "Concurrency": "taskloop.define.limits",
    "ErrorInfo": "taskloop.runtime.models",
    "Event": "taskloop.core.events",
    "Hook": "taskloop.ops.hooks",
    "PhaseBegan": "taskloop.ops.hooks",
    "PhaseEnded": "taskloop.ops.hooks",
    "RunEnded": "taskloop.ops.hooks",
    "ExecView": "taskloop.runtime.models",
    "LoopCheck": "taskloop.define.options",
    "LoopContext": "taskloop.define.context",
    "Plateau": "taskloop.define.options",
    "RateLimit": "taskloop.define.limits",
    "Retry": "taskloop.define.options",
    "RoundView": "taskloop.runtime.models",
    "RunHandle": "taskloop.runtime.client",
    "RunResult": "taskloop.runtime.models",
    "RunSummary": "taskloop.runtime.models",
    "RunView": "taskloop.runtime.models",
    "Signal": "taskloop.define.context",
    "StreamChunk": "taskloop.core.streamed",
    "Task": "taskloop.define.tasks",
    "TaskContext": "taskloop.define.context",
    "TaskLoop": "taskloop.runtime.client",
    "TaskView": "taskloop.runtime.models",
    "ThrottleView": "taskloop.runtime.models",
    "Transition": "taskloop.define.graph_spec",
    "TransitionHandler": "taskloop.define.graph_spec",
    "Workflow": "taskloop.define.workflow",
    "add_hook": "taskloop.runtime.instruments",
    "define_gate": "taskloop.define.tasks",
    "define_graph_workflow": "taskloop.define.graph",
    "define_loop_task": "taskloop.define.tasks",
    "define_task": "taskloop.define.tasks",
    "define_workflow": "taskloop.define.workflow",
    "llm_check": "taskloop.define.flow",
    "llm_score": "taskloop.define.flow",
    "loop": "taskloop.define.flow",
    "step": "taskloop.define.graph",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'taskloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ActionTimeout",
    "Activation",
    "Budget",
    "Cache",
    "CancelResult",
    "Cancelled",
    "CommitConflict",
    "Concurrency",
    "ConnectionConfigError",
    "CorruptRecord",
    "DefinitionError",
    "ErrorInfo",
    "Event",
    "ExecView",
    "GateRefused",
    "GraphLimitReached",
    "GraphRunFailed",
    "Hook",
    "IncompatibleDefinition",
    "InvalidCacheKey",
    "InvalidCheckResult",
    "InvalidInput",
    "InvalidOutput",
    "LLMCallFailed",
    "LLMNotConfigured",
    "LoopCheck",
    "LoopContext",
    "LoopIterationError",
    "LoopTaskExhausted",
    "NotForkable",
    "NotResumable",
    "OutputTooLarge",
    "PhaseAbandoned",
    "PhaseBegan",
    "PhaseEnded",
    "Plateau",
    "RateLimit",
    "Retry",
    "RoundView",
    "RunEnded",
    "RunExists",
    "RunHandle",
    "RunNotFound",
    "RunRejected",
    "RunResult",
    "RunSummary",
    "RunTimeout",
    "RunView",
    "Signal",
    "StoreAccessDenied",
    "StoreUnavailable",
    "StreamChunk",
    "Task",
    "TaskContext",
    "TaskFailed",
    "TaskLoop",
    "TaskLoopError",
    "TaskTimeout",
    "TaskView",
    "ThrottleView",
    "Transition",
    "TransitionHandler",
    "Workflow",
    "WorkflowBudgetExceeded",
    "WorkflowNotRegistered",
    "add_hook",
    "define_gate",
    "define_graph_workflow",
    "define_loop_task",
    "define_task",
    "define_workflow",
    "llm_check",
    "llm_score",
    "loop",
    "step",
]
