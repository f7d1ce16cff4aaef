"""A writer/reviewer loop on a model: the writer streams each round's draft from the model as it
writes it (seen live by `taskloop watch`, the run page and `client.stream`), and the reviewer, the
same model, grades it from 0 to 10 with notes that the next draft answers. It passes at 8; it stops
early when two rounds in a row do not beat the best score by half a point (a plateau); and if it
runs out, it keeps the best-scoring draft instead of failing, so the run ends with something to
publish.

    export TASKLOOP_LLM_BASE_URL=http://127.0.0.1:8000/v1 TASKLOOP_LLM_MODEL=my-model   # any OpenAI-compatible server
    taskloop worker --import examples.writer_reviewer -P threads -c 20 &
    run=$(taskloop start article --import examples.writer_reviewer --input '{"topic": "bounded loops"}')
    taskloop watch $run                  # each draft as the model writes it, then the run's status
    taskloop fork $run draft 2 --feedback "shorter, and cite a source" --wait --import examples.writer_reviewer

The writer asks the endpoint in its streaming mode (``"stream": true``, taskloop's small client:
``llm.stream_chat``; any client that yields tokens will do); the reviewer is ``tl.llm_score``.
"""

from __future__ import annotations

import taskloop as tl
from taskloop.connections import llm

WRITER = "You write short, concrete drafts for engineers."


def prompt(ctx: tl.LoopContext, feedback: str | None) -> str:
    topic = ctx.input.get("topic", "bounded loops")
    ask = f"Write draft {ctx.round} of a short note on {topic}: why a loop needs a bound, and how to watch it."
    return f"{ask}\nRevise it for this review: {feedback}" if feedback else ask


def write(ctx: tl.LoopContext, feedback: str | None) -> str:
    parts = []
    reply = llm.stream_chat(prompt(ctx, feedback), system=WRITER)
    for token in reply:
        ctx.stream(token)            # seen live: client.stream, taskloop watch, the run page
        parts.append(token)
    ctx.report_usage(**reply.usage.model_dump())
    return "".join(parts)


draft = tl.define_loop_task(
    "draft", max_rounds=5, attempt=write,
    check=tl.llm_score("How ready to publish is this draft?", passing=8),
    plateau=tl.Plateau(rounds=2, min_gain=0.5), on_exhausted="best",
)
publish = tl.define_task("publish", run=lambda ctx: {"published": ctx.value(draft)}, after=[draft])
article = tl.define_workflow("article", version="1", tasks=[draft, publish])
