"""Flows for tests/integration/test_tracing.py: a loop whose rounds report usage and make a span of
their own inside the callback (as a model client's instrumentation would), then a plain task that
fails its first try and is retried after a delay (its message then goes through Celery's own send,
collected by the outbox); a task that fails; a gate between two tasks; a loop checked by the model
(``tl.llm_check``); and a task that notes which opentelemetry modules (and taskloop.ops.otel) its
process has loaded (``test:<run>:otel``), for the worker with tracing off."""

from __future__ import annotations

import json
import os
import sys

import redis

import taskloop as tl


def _note(ctx: tl.TaskContext, what: str, value: object) -> None:
    client = redis.Redis.from_url(os.environ["TASKLOOP_REDIS_URL"])
    try:
        client.rpush(f"test:{ctx.run_id}:{what}", json.dumps(value))
    finally:
        client.close()


def write(ctx: tl.LoopContext, feedback: str | None) -> int:
    from opentelemetry import trace

    ctx.report_usage(input=10, output=5)
    with trace.get_tracer("a-model-client").start_as_current_span("model.generate"):
        return ctx.round


def review(ctx: tl.LoopContext, draft: int) -> tl.LoopCheck:
    return tl.LoopCheck(done=draft >= 2, feedback="longer", score=draft / 2)


def flaky(ctx: tl.TaskContext) -> str:
    if ctx.attempt == 1:
        raise ConnectionError("first try fails")
    return "published"


def boom(ctx: tl.TaskContext) -> None:
    raise ValueError("no luck")


def loaded(ctx: tl.TaskContext) -> int:
    _note(ctx, "otel", sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry"
                              or name.startswith("taskloop.ops.otel")))
    return 1


draft = tl.define_loop_task("draft", attempt=write, check=review, max_rounds=3)
traced = tl.define_workflow("traced", version="1", tasks=[
    draft, tl.define_task("publish", run=flaky, after=[draft], retry=tl.Retry(2, delay_ms=300))])
traced_fails = tl.define_workflow("traced-fails", version="1", tasks=[tl.define_task("boom", run=boom)])
prep = tl.define_task("prep", run=lambda ctx: "prepared")
approval = tl.define_gate("approval", prompt="Ship it?", after=[prep])
traced_gate = tl.define_workflow("traced-gate", version="1", tasks=[
    prep, approval, tl.define_task("ship", run=lambda ctx: "shipped", after=[approval])])
traced_judged = tl.define_workflow("traced-judged", version="1", tasks=[
    tl.define_loop_task("essay", attempt=lambda ctx, feedback: f"essay {ctx.round}",
                        check=tl.llm_check("Is this essay done?"), max_rounds=3)])
# on a queue of its own: only the worker that buffers its spans takes it
buffered = tl.define_workflow("traced-buffered", version="1", tasks=[
    tl.define_task("once", run=lambda ctx: 1, queue="buffered")])
# on a queue of its own: only the worker with tracing off takes it
untraced = tl.define_workflow("untraced", version="1", tasks=[tl.define_task("look", run=loaded, queue="untraced")])
