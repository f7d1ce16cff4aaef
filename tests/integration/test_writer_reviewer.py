"""examples/writer_reviewer.py on a real worker against the local chat-completions server: the
model grades each round (tl.llm_score), the loop stops on a plateau and keeps the best draft
(on_exhausted="best"), and a fork from the best round with new feedback goes on from there."""

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


def test_the_model_grades_the_rounds_and_the_best_draft_is_kept_on_a_plateau(graded) -> None:
    from examples.writer_reviewer import article

    client, chat = graded
    chat.script(Reply("score: 5\nToo vague: name one failure a bound prevents."),
                Reply("Score: 7.5/10\nBetter. Cite a source."),
                Reply("score: 7\nThe source is weak."),
                Reply("score: 7.4\nStill the same problems."))
    result = client.start(article, {"topic": "bounded loops"}).wait(timeout=60)
    # round 4 did not beat round 2's 7.5 by 0.5 within two rounds: a plateau; round 2 is kept
    assert result.status == "done"
    assert result.values["draft"].startswith("Draft 2 on bounded loops")
    view = client.inspect(result.run_id)
    draft = view.tasks["draft"]
    assert (draft.exhausted, draft.kept_round) == ("plateau", 2)
    assert [r.check["score"] for r in draft.rounds] == [5.0, 7.5, 7.0, 7.4]
    assert draft.rounds[1].check["feedback"].startswith("Score: 7.5/10")
    assert "Give a score from 0 to 10" in chat.requests[0].body["messages"][-1]["content"]
    assert result.values["publish"] == {"published": result.values["draft"]}
    # a fork from round 3 with an editor's feedback: rounds 1-2 copied, the model grades round 3 again
    chat.script(Reply("score: 9\nReady."))
    fork = client.fork(result.run_id, "draft", 3, "shorter, and cite a source")
    forked = fork.wait(timeout=60)
    assert forked.status == "done" and forked.values["draft"].endswith("Revised for: shorter, and cite a source")
    rounds = client.inspect(fork.run_id).tasks["draft"].rounds
    assert [(r.round, r.copied, r.check["score"]) for r in rounds] == [(1, True, 5.0), (2, True, 7.5), (3, False, 9.0)]
