"""examples/writer_reviewer.py on a real worker against the local chat-completions server: the
writer streams each draft from the model's streaming mode (ctx.stream: the live text of each
round is its recorded draft), the model grades each round (tl.llm_score), the loop stops on a
plateau and keeps the best draft (on_exhausted="best"), and a fork from the best round with new
feedback goes on from there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from taskloop.ops.embedded import RedisServer
from taskloop.runtime.client import TaskLoop
from tests.llm_server import ChatServer, Reply
from tests.workers import WorkerProcess


@pytest.fixture()
def graded(tmp_path: Path) -> Iterator[tuple[TaskLoop, ChatServer]]:
    """A private Redis and a worker whose model is the local chat server."""
    (tmp_path / "redis").mkdir()
    with RedisServer(tmp_path / "redis") as server, ChatServer() as chat:
        env = {"TASKLOOP_LLM_BASE_URL": chat.base_url, "TASKLOOP_LLM_MODEL": "grader-1"}
        worker = WorkerProcess(server.url, ["examples.writer_reviewer"], tmp_path / "worker.log", name="wr", env=env)
        client = TaskLoop(server.url)
        try:
            worker.ready()
            yield client, chat
        finally:
            client.close()
            worker.terminate()
            worker.wait(30)


def drafts(*texts: str) -> list[Reply]:
    """The writer's replies, streamed a word every 10 ms."""
    return [Reply(text, token_delay_s=0.01, usage={"prompt_tokens": 30, "completion_tokens": len(text.split()),
                                                   "total_tokens": 30 + len(text.split())}) for text in texts]


def test_the_model_grades_the_rounds_and_the_best_draft_is_kept_on_a_plateau(graded) -> None:
    from examples.writer_reviewer import article

    client, chat = graded
    written = [f"Draft {n} on bounded loops: a bound stops a loop that would run forever, and a watched "
               f"loop says which round it is in. (take {n})" for n in range(1, 5)]
    first, second, third, fourth = drafts(*written)
    chat.script(first, Reply("score: 5\nToo vague: name one failure a bound prevents."),
                second, Reply("Score: 7.5/10\nBetter. Cite a source."),
                third, Reply("score: 7\nThe source is weak."),
                fourth, Reply("score: 7.4\nStill the same problems."))
    handle = client.start(article, {"topic": "bounded loops"})
    result = handle.wait(timeout=60)
    # round 4 did not beat round 2's 7.5 by 0.5 within two rounds: a plateau; round 2 is kept
    assert result.status == "done"
    assert result.values["draft"] == written[1]
    view = client.inspect(result.run_id)
    draft = view.tasks["draft"]
    assert (draft.exhausted, draft.kept_round) == ("plateau", 2)
    assert [r.check["score"] for r in draft.rounds] == [5.0, 7.5, 7.0, 7.4]
    assert draft.rounds[1].check["feedback"].startswith("Score: 7.5/10")
    # the writer asked in the streaming mode, with the last review; each draft was streamed as written
    writes = [r.body for r in chat.requests if r.body.get("stream")]
    assert len(writes) == 4 and "Revise it for this review: score: 5\nToo vague" in writes[1]["messages"][-1]["content"]
    streamed = list(handle.stream(task="draft"))
    for found in draft.rounds:
        assert "".join(c.text for c in streamed if c.round == found.round and c.phase == "attempt") == found.output
    assert result.usage["tokens"]["output"] >= sum(len(text.split()) for text in written)
    assert "Give a score from 0 to 10" in chat.requests[1].body["messages"][-1]["content"]
    assert result.values["publish"] == {"published": result.values["draft"]}
    # a fork from round 3 with an editor's feedback: rounds 1-2 copied, round 3 written and graded again
    chat.script(*drafts("Draft 3, shorter, citing Hoare."), Reply("score: 9\nReady."))
    fork = client.fork(result.run_id, "draft", 3, "shorter, and cite a source")
    forked = fork.wait(timeout=60)
    assert forked.status == "done" and forked.values["draft"] == "Draft 3, shorter, citing Hoare."
    assert "Revise it for this review: shorter, and cite a source" in chat.requests[-2].body["messages"][-1]["content"]
    rounds = client.inspect(fork.run_id).tasks["draft"].rounds
    assert [(r.round, r.copied, r.check["score"]) for r in rounds] == [(1, True, 5.0), (2, True, 7.5), (3, False, 9.0)]
