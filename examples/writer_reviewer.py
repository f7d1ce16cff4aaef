"""A writer/reviewer loop graded by a model: each round's draft gets a score from 0 to 10 and the
reviewer's notes, which the next draft answers. It passes at 8; it stops early when two rounds in
a row do not beat the best score by half a point (a plateau); and if it runs out, it keeps the
best-scoring draft instead of failing, so the run ends with something to publish.

    export TASKLOOP_LLM_BASE_URL=http://127.0.0.1:8000/v1 TASKLOOP_LLM_MODEL=my-model   # any OpenAI-compatible server
    taskloop worker --import examples.writer_reviewer -c 2 &
    taskloop start article --import examples.writer_reviewer --input '{"topic": "bounded loops"}' --wait
    taskloop fork <run id> draft 2 --feedback "shorter, and cite a source" --wait --import examples.writer_reviewer

The writer here is a plain function (swap in your model call); the reviewer is ``tl.llm_score``.
"""

from __future__ import annotations

import taskloop as tl


def write(ctx: tl.LoopContext, feedback: str | None) -> str:
    topic = ctx.input.get("topic", "bounded loops")
    draft = f"Draft {ctx.round} on {topic}: why a loop needs a bound, and how to watch it."
    return f"{draft}\nRevised for: {feedback.splitlines()[0] if feedback else 'a first reading'}"


draft = tl.define_loop_task(
    "draft", max_rounds=5, attempt=write,
    check=tl.llm_score("How ready to publish is this draft?", passing=8),
    plateau=tl.Plateau(rounds=2, min_gain=0.5), on_exhausted="best",
)
publish = tl.define_task("publish", run=lambda ctx: {"published": ctx.value(draft)}, after=[draft])
article = tl.define_workflow("article", version="1", tasks=[draft, publish])
