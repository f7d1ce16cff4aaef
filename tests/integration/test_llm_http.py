"""taskloop.connections.llm against a real local chat-completions server (tests/llm_server.py; loopback only)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from taskloop.base.errors import LLMCallFailed
from taskloop.connections import llm
from tests.llm_server import ChatServer, Reply, llm_server_fixture

llm_server = llm_server_fixture()

KEY = "sk-test-0123456789"
QUESTION = "Have all the failing tests been fixed?"
STATE = {"failing": [], "passes": 3}


def config(server: ChatServer, key: str | None = KEY, base_url: str | None = None) -> llm.LLMConfig:
    return llm.LLMConfig(base_url=base_url or server.base_url, model="test-model", api_key=key)  # type: ignore[arg-type]


def test_a_yes_reply_is_affirmative(llm_server: ChatServer) -> None:
    # Given a server that answers yes, with usage
    llm_server.script(Reply("Yes, all tests pass.", usage={
        "prompt_tokens": 120, "completion_tokens": 5, "total_tokens": 125,
        "prompt_tokens_details": {"cached_tokens": 96},
    }))

    # When the question is asked
    verdict = llm.ask(QUESTION, STATE, config=config(llm_server))

    # Then the verdict holds the reply, the judgement, the usage and what was sent
    assert verdict.reply == "Yes, all tests pass."
    assert verdict.affirmative is True
    assert verdict.usage == llm.LLMUsage(input=120, cached=96, output=5)
    assert verdict.model == "test-model"
    assert verdict.question == QUESTION
    assert 0 < verdict.latency_s < 10
    assert verdict.messages == llm.build_messages(QUESTION, STATE)

    # And the request was one chat completion with the documented body and the bearer key
    [request] = llm_server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.headers["content-type"] == "application/json"
    assert request.body == {
        "model": "test-model",
        "messages": [m.model_dump() for m in verdict.messages],
        "max_tokens": llm.MAX_REPLY_TOKENS,
        "temperature": 0,
    }
    assert '"failing": []' in request.body["messages"][1]["content"]


def test_a_no_reply_is_not_affirmative(llm_server: ChatServer) -> None:
    llm_server.script(Reply("No. Two tests still fail."))

    verdict = llm.ask(QUESTION, STATE, config=config(llm_server))

    assert (verdict.reply, verdict.affirmative) == ("No. Two tests still fail.", False)
    assert verdict.usage == llm.LLMUsage(input=0, cached=0, output=0)


def test_configuration_comes_from_the_environment(llm_server: ChatServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # A trailing slash on the base URL, and no key (a local server): no Authorization header
    monkeypatch.setenv(llm.ENV_BASE_URL, llm_server.base_url + "/")
    monkeypatch.setenv(llm.ENV_MODEL, "env-model")
    monkeypatch.delenv(llm.ENV_API_KEY, raising=False)
    llm_server.script(Reply("done"))

    verdict = llm.ask(QUESTION, STATE)

    assert verdict.affirmative and verdict.model == "env-model"
    [request] = llm_server.requests
    assert request.path == "/v1/chat/completions"
    assert "authorization" not in request.headers
    assert request.body["model"] == "env-model"


def test_a_given_client_is_reused(llm_server: ChatServer) -> None:
    llm_server.script(Reply("no"), Reply("finished"))

    with httpx.Client() as client:
        first = llm.ask(QUESTION, {"round": 1}, config=config(llm_server), client=client)
        second = llm.ask(QUESTION, {"round": 2}, config=config(llm_server), client=client)
        assert not client.is_closed

    assert (first.affirmative, second.affirmative) == (False, True)
    assert len(llm_server.requests) == 2


def test_the_verdict_survives_json_after_a_real_call(llm_server: ChatServer) -> None:
    verdict = llm.ask(QUESTION, STATE, config=config(llm_server))
    assert llm.LLMVerdict.model_validate_json(verdict.model_dump_json()) == verdict


# --- failures ----------------------------------------------------------------------------------


def assert_clean(error: LLMCallFailed, server: ChatServer) -> None:
    message = str(error)
    assert message.startswith(f"LLM call failed: POST {server.base_url}/chat/completions ")
    assert KEY not in message and KEY not in repr(error.args)


def test_http_500_is_a_failed_call(llm_server: ChatServer) -> None:
    llm_server.script(Reply(status=500))

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server))

    error = info.value
    assert_clean(error, llm_server)
    assert "answered HTTP 500" in str(error) and "scripted failure" in str(error)
    assert str(error).endswith("; see the server's log")
    assert (error.status, error.retryable, error.url) == (500, True, f"{llm_server.base_url}/chat/completions")


def test_http_401_names_the_key_variable(llm_server: ChatServer) -> None:
    llm_server.script(Reply(status=401))

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server))

    assert_clean(info.value, llm_server)
    assert str(info.value).endswith("; check TASKLOOP_LLM_API_KEY")
    assert (info.value.status, info.value.retryable) == (401, False)


def test_a_wrong_base_url_names_the_base_url_variable(llm_server: ChatServer) -> None:
    base = llm_server.base_url.removesuffix("/v1")  # forgot the /v1

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server, base_url=base))

    assert llm_server.requests[0].path == "/chat/completions"
    assert "answered HTTP 404" in str(info.value)
    assert "check TASKLOOP_LLM_BASE_URL (usually ending in /v1) and TASKLOOP_LLM_MODEL" in str(info.value)


def test_a_timeout_is_a_failed_call(llm_server: ChatServer) -> None:
    llm_server.script(Reply("yes", delay_s=5))

    started = time.monotonic()
    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server), timeout=0.3)

    assert time.monotonic() - started < 3
    assert_clean(info.value, llm_server)
    assert "timed out after 0.3s; check that the server is up, or pass a longer timeout" in str(info.value)
    assert (info.value.status, info.value.retryable) == (None, True)
    assert isinstance(info.value.__cause__, httpx.TimeoutException)


def test_a_refused_connection_is_a_failed_call() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}/v1"

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=llm.LLMConfig(base_url=base, model="m"), timeout=2)

    assert str(info.value).startswith(f"LLM call failed: POST {base}/chat/completions failed (ConnectError")
    assert str(info.value).endswith("check that an OpenAI-compatible server listens at TASKLOOP_LLM_BASE_URL")
    assert info.value.retryable


def test_a_base_url_without_scheme_is_a_failed_call() -> None:
    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=llm.LLMConfig(base_url="127.0.0.1:8000/v1", model="m"), timeout=2)

    assert "failed (UnsupportedProtocol" in str(info.value)
    assert str(info.value).endswith("check that an OpenAI-compatible server listens at TASKLOOP_LLM_BASE_URL")


@pytest.mark.parametrize(
    "reply",
    [
        Reply(body="this is not JSON"),
        Reply(body=json.dumps({"choices": []})),
        Reply(body=json.dumps({"object": "list", "data": []})),
        Reply(body=json.dumps([1, 2])),
        Reply(content=None),  # e.g. a tool call or a refusal without text
    ],
)
def test_a_malformed_reply_is_a_failed_call(llm_server: ChatServer, reply: Reply) -> None:
    llm_server.script(reply)

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server))

    assert_clean(info.value, llm_server)
    assert "returned a malformed reply" in str(info.value)
    assert str(info.value).endswith("check that TASKLOOP_LLM_BASE_URL points at an OpenAI-compatible endpoint")
    assert (info.value.status, info.value.retryable) == (200, False)


def test_the_key_never_leaks_into_messages(llm_server: ChatServer) -> None:
    # Given a server whose error body echoes the key
    llm_server.script(Reply(status=403, body=json.dumps({"error": f"bad key {KEY}"})))

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server))

    # Then the message shows the echo with the key masked
    assert_clean(info.value, llm_server)
    assert "bad key ***" in str(info.value)
    assert llm_server.requests[0].headers["authorization"] == f"Bearer {KEY}"  # it was sent, only not shown


def test_a_password_in_the_base_url_is_not_shown(llm_server: ChatServer) -> None:
    llm_server.script(Reply(status=500))
    base = llm_server.base_url.replace("http://", "http://user:hunter2@")

    with pytest.raises(LLMCallFailed) as info:
        llm.ask(QUESTION, STATE, config=config(llm_server, key=None, base_url=base))

    assert_clean(info.value, llm_server)
    assert "hunter2" not in str(info.value) and "user:" not in str(info.value)
    assert info.value.url == f"{llm_server.base_url}/chat/completions"
    assert llm_server.requests[0].headers["authorization"].startswith("Basic ")  # httpx sends it as basic auth


# --- the streaming mode (stream_chat) ------------------------------------------------------------------


def test_a_streamed_reply_comes_piece_by_piece_as_the_server_sends_it(llm_server: ChatServer) -> None:
    # Given a server that streams a reply a word at a time, 50 ms apart, and reports its usage last
    llm_server.script(Reply("Bounded loops end. They are watched.", token_delay_s=0.05,
                            usage={"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}))
    stream = llm.stream_chat("Write about loops.", system="Be brief.", config=config(llm_server))
    # When it is read
    arrivals = []
    for piece in stream:
        arrivals.append((time.perf_counter(), piece))
    # Then the pieces come as they are sent (not all at the end), and add up to the reply
    assert [p for _, p in arrivals] == ["Bounded ", "loops ", "end. ", "They ", "are ", "watched."]
    assert arrivals[-1][0] - arrivals[0][0] >= 0.2
    assert stream.usage == llm.LLMUsage(input=12, cached=0, output=6)
    [request] = llm_server.requests
    assert request.body["stream"] is True and request.body["stream_options"] == {"include_usage": True}
    assert request.body["messages"] == [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Write about loops."}]
    assert request.headers["authorization"] == f"Bearer {KEY}"
    with pytest.raises(RuntimeError, match="read once"):
        list(stream)


@pytest.mark.parametrize(("reply", "found"), [
    (Reply(status=500), "answered HTTP 500"),
    (Reply(body="data: {not json}\n\n"), "returned a malformed reply"),
    (Reply(body='data: {"choices": [{"delta": {"content": 3}}]}\n\n'), "delta content is int"),
])
def test_a_streamed_call_that_fails_is_a_failed_call(llm_server: ChatServer, reply: Reply, found: str) -> None:
    llm_server.script(reply)
    with pytest.raises(LLMCallFailed, match=found) as caught:
        list(llm.stream_chat("Write.", config=config(llm_server)))
    assert KEY not in str(caught.value)


def test_a_streamed_call_to_nowhere_is_a_failed_call() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    where = llm.LLMConfig(base_url=f"http://127.0.0.1:{port}/v1", model="m")
    with pytest.raises(LLMCallFailed, match="check that an OpenAI-compatible server listens at TASKLOOP_LLM_BASE_URL"):
        list(llm.stream_chat("Write.", config=where))
