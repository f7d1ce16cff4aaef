"""The one error hierarchy (taskloop/base/errors.py) and the public API that exports it."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import taskloop as tl
from taskloop.base import errors
from taskloop.core.records import ErrorRecord
from taskloop.core.rules import termination_for
from taskloop.core.states import Termination

# raised by taskloop to itself, caught inside (the UI's answer 403, the CLI's one line)
INTERNAL = {"IllegalTransition", "Superseded", "LimitRefused", "OutboxUnsupported", "UIRefused", "ActionRefused",
            "PoolRefused"}
# the modules of an extra, and what they need: imported only when it is installed (taskloop[otel])
EXTRAS = {"taskloop.ops.otel": "opentelemetry"}


def test_every_error_class_lives_in_base_errors_and_derives_from_taskloop_error() -> None:
    found = {}
    for module in pkgutil.walk_packages(tl.__path__, "taskloop."):
        if module.name.endswith("__main__"):
            continue  # running it would run the command line
        if module.name in EXTRAS and importlib.util.find_spec(EXTRAS[module.name]) is None:
            continue
        loaded = importlib.import_module(module.name)
        for name, value in vars(loaded).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.name:
                found[name] = module.name
    assert {name: where for name, where in found.items() if where != "taskloop.base.errors"} == {}
    for name, value in vars(errors).items():
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == errors.__name__:
            assert issubclass(value, errors.TaskLoopError), name


def test_every_error_a_user_can_receive_is_exported() -> None:
    public = {name for name, value in vars(errors).items() if inspect.isclass(value)
              and issubclass(value, errors.TaskLoopError) and value.__module__ == errors.__name__}
    assert public - INTERNAL <= set(tl.__all__)
    assert {"RunSummary", "NotResumable", "RunRejected", "CommitConflict", "GraphRunFailed", "GraphLimitReached",
            "LoopIterationError"} <= set(tl.__all__)
    for name in tl.__all__:
        assert getattr(tl, name) is not None


@pytest.mark.parametrize("cls", sorted(errors.RECORDED.values(), key=lambda c: c.__name__))
def test_a_recorded_error_comes_back_as_its_class(cls: type[errors.TaskLoopError]) -> None:
    key = "" if not issubclass(cls, errors.TaskFailed) and cls is not errors.CorruptRecord else "fix"
    details = {"max_rounds": 3, "feedback": "no"} if cls is errors.LoopTaskExhausted else {"traceback": "tb"}
    raised = errors.error_from_info(key, cls.__name__, "what happened", details)
    if cls is errors.CorruptRecord:  # a task's corrupt record is a task failure of that type
        assert type(raised) is errors.TaskFailed and raised.type == "CorruptRecord"  # type: ignore[attr-defined]
        return
    assert type(raised) is cls
    if cls is errors.LoopTaskExhausted:
        assert str(raised) == "Loop task fix exhausted its 3 rounds"


def test_a_user_error_comes_back_as_task_failed_with_its_type_name() -> None:
    raised = errors.error_from_info("fetch", "ValueError", "bad", {"traceback": "tb"})
    assert type(raised) is errors.TaskFailed and raised.type == "ValueError" and raised.traceback == "tb"
    assert type(errors.error_from_info("", "SomethingElse", "m", None)) is errors.TaskLoopError


@pytest.mark.parametrize(("type_name", "termination", "resumable"), [
    ("TaskTimeout", Termination.TIMEOUT, True), ("WorkflowBudgetExceeded", Termination.LIMIT, False),
    ("LoopTaskExhausted", Termination.FAILED, False), ("GraphLimitReached", Termination.LIMIT, True),
    ("GraphRunFailed", Termination.FAILED, True), ("ValueError", Termination.FAILED, True),
])
def test_one_table_gives_termination_and_resumability(type_name: str, termination: Termination,
                                                      resumable: bool) -> None:
    record = ErrorRecord(type=type_name, message="m")
    assert termination_for(record) is termination
    assert record.resumable is resumable


@pytest.mark.parametrize("cls", sorted(errors.ACTION_ERRORS.values(), key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_a_workers_refusal_of_an_action_comes_back_as_its_class(cls: type[errors.TaskLoopError]) -> None:
    # Given the type name and message a worker stored as its verdict (runtime/acting.py)
    found = errors.action_error(cls.__name__, "the worker's words: what to do")
    # Then the caller raises that very class with the worker's message
    assert type(found) is cls and str(found) == "the worker's words: what to do"


def test_a_refusal_of_another_type_names_it_and_a_missing_run_keeps_its_id() -> None:
    other = errors.action_error("KeyError", "'x'")
    assert type(other) is errors.TaskLoopError and str(other) == "KeyError: 'x'"
    plain = errors.action_error("TaskLoopError", "the worker failed to carry out the request: boom")
    assert str(plain) == "the worker failed to carry out the request: boom"
    missing = errors.action_error("RunNotFound", str(errors.RunNotFound("r-1")))
    assert type(missing) is errors.RunNotFound and missing.run_id == "r-1"
    assert str(missing) == str(errors.RunNotFound("r-1"))
