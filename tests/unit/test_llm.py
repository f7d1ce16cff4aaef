"""taskloop.connections.llm without a server: the affirmative rule, the prompt, usage mapping, configuration errors."""

from __future__ import annotations

import json
import pickle

import pytest

from taskloop.base.errors import LLMCallFailed, LLMNotConfigured, TaskLoopError
from taskloop.connections import llm

# Go Micro flow/loop.go isAffirmative: strings.ToLower(strings.TrimSpace(s)), then strings.HasPrefix with
# yes, done, true, complete, finished. The first seven rows are Go Micro's own TestIsAffirmative table.
AFFIRMATIVE_CASES = [
    ("yes", True),
    ("Yes, the goal is met.", True),
    ("DONE", True),
    ("complete", True),
    ("no", False),
    ("not yet", False),
    ("", False),
    # each prefix, any case
    ("Yes", True),
    ("YES.", True),
    ("done!", True),
    ("True", True),
    ("COMPLETE - all tests pass", True),
    ("Finished.", True),
    ("finished", True),
    # surrounding whitespace is trimmed (Go's TrimSpace)
    ("  yes", True),
    ("\n\tDone\n", True),
    ("\u00a0yes", True),  # a no-break space is whitespace for Go's TrimSpace and Python's strip
    ("   ", False),
    # a prefix test, not a word test: these count, as they do in Go Micro
    ("yesterday", True),
    ("completed", True),
    ("completely wrong", True),
    ("true-ish", True),
    ("truly", False),  # "tru" + "ly": not the prefix "true"
    # anything before the word (punctuation, markup, other words) makes it not affirmative
    ('"yes"', False),
    ("**Yes**", False),
    ("- yes", False),
    ("Answer: yes", False),
    ("I think yes", False),
    ("no, not done", False),
    ("not done", False),
    ("incomplete", False),
    ("false", False),
    ("nope", False),
    ("y", False),
    ("ok", False),
    ("affirmative", False),
]


@pytest.mark.parametrize(("reply", "expected"), AFFIRMATIVE_CASES)
def test_is_affirmative(reply: str, expected: bool) -> None:
    assert llm.is_affirmative(reply) is expected


def test_affirmative_prefixes_are_go_micros() -> None:
    assert llm.AFFIRMATIVE_PREFIXES == ("yes", "done", "true", "complete", "finished")


# --- prompt ------------------------------------------------------------------------------------


def test_build_messages_asks_the_question_about_the_state() -> None:
    messages = llm.build_messages("Is the draft good enough?", {"text": "draft", "quality": 90})

    assert [m.role for m in messages] == ["system", "user"]
    assert "yes or no" in messages[0].content
    user = messages[1].content
    assert user.startswith("Is the draft good enough?\n\nLatest state (JSON):\n")
    assert '{"quality": 90, "text": "draft"}' in user  # JSON, keys sorted
    assert user.endswith('Answer "yes" or "no".')


@pytest.mark.parametrize(
    ("state", "text"),
    [
        (None, "null"),
        ("a string", '"a string"'),
        (12, "12"),
        ([1, True, None], "[1, true, null]"),
        ({"b": 1, "a": "é"}, '{"a": "é", "b": 1}'),  # non-ASCII kept as is
    ],
)
def test_render_state_is_json(state: object, text: str) -> None:
    assert llm.render_state(state) == text


def test_render_state_uses_repr_for_what_json_cannot_hold() -> None:
    assert llm.render_state({"s": {1}}) == '{"s": "{1}"}'


def test_render_state_is_cut_to_the_documented_size() -> None:
    state = "x" * (llm.MAX_STATE_CHARS * 2)
    text = llm.render_state(state)
    full = json.dumps(state)

    note = f"\n[truncated: the first {llm.MAX_STATE_CHARS} of {len(full)} characters]"
    assert text == full[: llm.MAX_STATE_CHARS] + note


def test_render_state_at_the_limit_is_not_cut() -> None:
    state = "x" * 8  # dumps to 10 characters with its quotes
    assert llm.render_state(state, max_chars=10) == '"xxxxxxxx"'
    assert llm.render_state(state, max_chars=9) == '"xxxxxxxx\n[truncated: the first 9 of 10 characters]'


def test_build_messages_truncates_the_state() -> None:
    user = llm.build_messages("Done?", "y" * 100, max_state_chars=20)[1].content
    assert f'"{"y" * 19}\n[truncated: the first 20 of 102 characters]' in user


# --- usage -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        ({"usage": {"prompt_tokens": 120, "completion_tokens": 3, "total_tokens": 123}}, (120, 0, 3)),
        ({"usage": {"prompt_tokens": 120, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 100}}},
         (120, 100, 3)),
        ({"usage": {"prompt_tokens": 7, "completion_tokens": 1, "prompt_tokens_details": None}}, (7, 0, 1)),
        ({"usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": None}}}, (7, 0, 0)),
        ({"usage": None}, (0, 0, 0)),
        ({}, (0, 0, 0)),
        ({"usage": {"prompt_tokens": "7", "completion_tokens": -1, "prompt_tokens_details": {"cached_tokens": 1.5}}},
         (0, 0, 0)),
        ({"usage": {"prompt_tokens": True}}, (0, 0, 0)),
        ([], (0, 0, 0)),
    ],
)
def test_parse_usage_maps_to_input_cached_output(body: object, usage: tuple[int, int, int]) -> None:
    parsed = llm.parse_usage(body)
    assert (parsed.input, parsed.cached, parsed.output) == usage
    assert set(parsed.model_dump()) == {"input", "cached", "output"}  # ctx.report_usage(**usage.model_dump())


# --- configuration -----------------------------------------------------------------------------

ENV = (llm.ENV_BASE_URL, llm.ENV_MODEL, llm.ENV_API_KEY)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({}, "TASKLOOP_LLM_BASE_URL and TASKLOOP_LLM_MODEL"),
        ({"TASKLOOP_LLM_BASE_URL": "http://127.0.0.1:8000/v1"}, "TASKLOOP_LLM_MODEL"),
        ({"TASKLOOP_LLM_MODEL": "m", "TASKLOOP_LLM_API_KEY": "k"}, "TASKLOOP_LLM_BASE_URL"),
        ({"TASKLOOP_LLM_BASE_URL": "  ", "TASKLOOP_LLM_MODEL": ""}, "TASKLOOP_LLM_BASE_URL and TASKLOOP_LLM_MODEL"),
    ],
)
def test_not_configured(clean_env: pytest.MonkeyPatch, env: dict[str, str], missing: str) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)

    with pytest.raises(LLMNotConfigured) as info:
        llm.ask("Done?", {"n": 1})  # fails before any request

    assert str(info.value) == (
        "until_llm requires a model: set TASKLOOP_LLM_BASE_URL and TASKLOOP_LLM_MODEL (an OpenAI-compatible "
        "endpoint, e.g. http://127.0.0.1:8000/v1; TASKLOOP_LLM_API_KEY is optional); missing: " + missing
    )
    assert isinstance(info.value, TaskLoopError)


def test_config_from_env(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(llm.ENV_BASE_URL, " http://127.0.0.1:8000/v1/ ")
    clean_env.setenv(llm.ENV_MODEL, "qwen")
    config = llm.LLMConfig.from_env()

    assert (config.base_url, config.model, config.api_key) == ("http://127.0.0.1:8000/v1/", "qwen", None)
    assert config.url == "http://127.0.0.1:8000/v1/chat/completions"  # trailing slash handled

    clean_env.setenv(llm.ENV_API_KEY, "sk-secret-123")
    config = llm.LLMConfig.from_env()
    assert config.api_key is not None and config.api_key.get_secret_value() == "sk-secret-123"
    assert "sk-secret-123" not in repr(config) and "sk-secret-123" not in str(config)


def test_environment_is_read_at_call_time(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(LLMNotConfigured):
        llm.LLMConfig.from_env()
    clean_env.setenv(llm.ENV_BASE_URL, "http://127.0.0.1:1/v1")
    clean_env.setenv(llm.ENV_MODEL, "m")
    assert llm.LLMConfig.from_env().model == "m"


# --- values that cross process boundaries ---------------------------------------------------------


def test_verdict_round_trips_through_json() -> None:
    verdict = llm.LLMVerdict(
        question="Done?", messages=llm.build_messages("Done?", {"n": 1}), reply="yes", affirmative=True,
        usage=llm.LLMUsage(input=10, cached=4, output=1), model="m", latency_s=0.25,
    )
    dumped = verdict.model_dump(mode="json")

    assert json.loads(json.dumps(dumped)) == dumped
    assert llm.LLMVerdict.model_validate(dumped) == verdict
    assert dumped["usage"] == {"input": 10, "cached": 4, "output": 1}
    assert dumped["messages"][1]["role"] == "user"


def test_call_failed_pickles_with_its_details() -> None:
    error = LLMCallFailed("boom", url="http://h/v1/chat/completions", status=500, retryable=True)
    copy = pickle.loads(pickle.dumps(error))

    assert (str(copy), copy.url, copy.status, copy.retryable) == ("boom", error.url, 500, True)
    assert isinstance(copy, TaskLoopError)
