"""A small OpenAI-compatible chat-completions client: the model behind ``until_llm`` and ``tl.llm_check``.

``ask(question, state)`` sends one yes/no question about a state to ``{TASKLOOP_LLM_BASE_URL}/chat/completions``
(model ``TASKLOOP_LLM_MODEL``, optional bearer key ``TASKLOOP_LLM_API_KEY``; the environment is read at call
time) and returns an ``LLMVerdict``. The state is JSON-dumped and cut to ``MAX_STATE_CHARS`` characters (its
head is kept). ``is_affirmative`` is Go Micro's rule (flow/loop.go ``isAffirmative``): strip surrounding
whitespace, lowercase, and the reply is affirmative when it starts with yes, done, true, complete or finished.
Retries are the caller's (a Retry policy); the task's timeout and cancellation are the caller's too.

``stream_chat(prompt)`` asks for a reply in the endpoint's streaming mode (``"stream": true``) and yields it
piece by piece as the server sends it: what a writer passes to ``ctx.stream`` (examples/writer_reviewer.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, SecretStr

from taskloop.base.errors import LLMCallFailed, LLMNotConfigured

if TYPE_CHECKING:
    import httpx

ENV_BASE_URL, ENV_MODEL, ENV_API_KEY = "TASKLOOP_LLM_BASE_URL", "TASKLOOP_LLM_MODEL", "TASKLOOP_LLM_API_KEY"
AFFIRMATIVE_PREFIXES = ("yes", "done", "true", "complete", "finished")
MAX_STATE_CHARS = 16_000  # about 4k tokens of state in the prompt; the rest is cut (and the cut is said)
MAX_REPLY_TOKENS = 16  # enough for "yes"/"no" and a few words of reason
DEFAULT_TIMEOUT_S = 60.0
SYSTEM_PROMPT = "You judge whether a goal is met. Start your reply with yes or no."
YES_NO = 'Answer "yes" or "no".'
SCORE_PROMPT = "You grade work. Start your reply with the score, as score: N, then say what to improve."
SCORE_REPLY_TOKENS = 200  # a score and a few sentences of feedback
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class LLMConfig(BaseModel):
    """Where to ask: an OpenAI-compatible base URL (``http://127.0.0.1:8000/v1``), a model and an optional key."""

    model_config = ConfigDict(frozen=True)
    base_url: str
    model: str
    api_key: SecretStr | None = None

    @classmethod
    def from_env(cls) -> LLMConfig:
        base_url, model = os.environ.get(ENV_BASE_URL, "").strip(), os.environ.get(ENV_MODEL, "").strip()
        if not base_url or not model:
            missing = " and ".join(name for name, value in ((ENV_BASE_URL, base_url), (ENV_MODEL, model)) if not value)
            raise LLMNotConfigured(
                f"until_llm requires a model: set {ENV_BASE_URL} and {ENV_MODEL} (an OpenAI-compatible endpoint, "
                f"e.g. http://127.0.0.1:8000/v1; {ENV_API_KEY} is optional); missing: {missing}"
            )
        key = os.environ.get(ENV_API_KEY, "").strip()
        return cls(base_url=base_url, model=model, api_key=SecretStr(key) if key else None)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


class Message(BaseModel):
    model_config = ConfigDict(frozen=True)
    role: str
    content: str


class LLMUsage(BaseModel):
    """Token counts in taskloop's names (``ctx.report_usage(**usage.model_dump())``). ``input`` is the
    endpoint's prompt_tokens, which includes the ``cached`` ones."""

    model_config = ConfigDict(frozen=True)
    input: int = 0
    cached: int = 0
    output: int = 0


class LLMVerdict(BaseModel):
    """One yes/no judgement: what was sent, what came back, and what it cost (JSON-safe, recorded per round)."""

    model_config = ConfigDict(frozen=True)
    question: str
    messages: list[Message]
    reply: str
    affirmative: bool
    usage: LLMUsage
    model: str
    latency_s: float


def is_affirmative(reply: str) -> bool:
    """Go Micro's ``isAffirmative``: after trimming whitespace and lowercasing, the reply starts with yes, done,
    true, complete or finished. A plain prefix test: "Yes, the goal is met." and "DONE" count; "no", "not yet",
    "" and a reply that opens with punctuation ('"yes"', "**Yes**") do not."""
    return reply.strip().lower().startswith(AFFIRMATIVE_PREFIXES)


def render_state(state: Any, max_chars: int = MAX_STATE_CHARS) -> str:
    """The state as JSON (non-JSON leaves as their repr), cut to ``max_chars`` characters with a note."""
    text = json.dumps(state, ensure_ascii=False, sort_keys=True, default=repr)
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n[truncated: the first {max_chars} of {len(text)} characters]"


def build_messages(question: str, state: Any, max_state_chars: int = MAX_STATE_CHARS,
                   instruction: str = YES_NO, system: str = SYSTEM_PROMPT) -> list[Message]:
    """The prompt (after Go Micro's askDone): the question, the latest state, and an instruction
    (a yes/no answer; for a score, ``score_instruction``)."""
    user = f"{question}\n\nLatest state (JSON):\n{render_state(state, max_state_chars)}\n\n{instruction}"
    return [Message(role="system", content=system), Message(role="user", content=user)]


def score_instruction(scale: float) -> str:
    return f"Give a score from 0 to {scale:g} as 'score: N' on the first line, then what to improve."


def parse_score(reply: str, scale: float) -> float | None:
    """The score a grading reply gives ("score: 7", "Score = 6.5/10"), within [0, scale]; None when
    it gives none."""
    found = _SCORE.search(reply)
    if found is None:
        return None
    return min(max(float(found.group(1)), 0.0), scale)


def parse_usage(body: Any) -> LLMUsage:
    """``usage.prompt_tokens`` / ``completion_tokens`` / ``prompt_tokens_details.cached_tokens`` (absent: 0)."""
    usage = body.get("usage") if isinstance(body, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}

    def count(value: Any) -> int:
        return value if type(value) is int and value >= 0 else 0

    return LLMUsage(input=count(usage.get("prompt_tokens")), cached=count(details.get("cached_tokens")),
                    output=count(usage.get("completion_tokens")))


def _shown(url: str) -> str:
    """The URL without any user:password part (it goes into error messages)."""
    import httpx

    try:
        return str(httpx.URL(url).copy_with(userinfo=b""))
    except httpx.InvalidURL:
        return url.rpartition("@")[2]


class _Call:
    """One POST to the chat-completions endpoint: its headers, its URL as errors show it, and the
    errors it can end in (LLMCallFailed, the key never shown)."""

    def __init__(self, config: LLMConfig) -> None:
        self.config = config
        self.key = config.api_key.get_secret_value() if config.api_key else ""
        self.headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.url = _shown(config.url)

    def failed(self, problem: str, fix: str, status: int | None = None, retryable: bool = False) -> LLMCallFailed:
        message = f"LLM call failed: POST {self.url} {problem}; {fix}"
        return LLMCallFailed(message.replace(self.key, "***") if self.key else message, url=self.url, status=status,
                             retryable=retryable)

    def unsent(self, exc: Exception, timeout: float) -> LLMCallFailed:
        """What an httpx error before a reply comes to."""
        import httpx

        if isinstance(exc, httpx.TimeoutException):
            return self.failed(f"timed out after {timeout:g}s", "check that the server is up, or pass a longer timeout",
                               retryable=True)
        return self.failed(f"failed ({type(exc).__name__}: {exc})",
                           f"check that an OpenAI-compatible server listens at {ENV_BASE_URL}", retryable=True)

    def refused(self, status: int, text: str) -> LLMCallFailed:
        """What an HTTP error status comes to."""
        fix = {401: f"check {ENV_API_KEY}", 403: f"check {ENV_API_KEY}",
               404: f"check {ENV_BASE_URL} (usually ending in /v1) and {ENV_MODEL}"}.get(status, "see the server's log")
        return self.failed(f"answered HTTP {status} ({text[:200]!r})", fix, status,
                           retryable=status == 429 or status >= 500)

    def malformed(self, exc: Exception, text: str, status: int) -> LLMCallFailed:
        return self.failed(f"returned a malformed reply ({type(exc).__name__}: {exc}; body {text[:200]!r})",
                           f"check that {ENV_BASE_URL} points at an OpenAI-compatible endpoint", status)


def ask(question: str, state: Any, *, config: LLMConfig | None = None, timeout: float = DEFAULT_TIMEOUT_S,
        client: httpx.Client | None = None, max_tokens: int = MAX_REPLY_TOKENS,
        scale: float | None = None) -> LLMVerdict:
    """Ask the model a yes/no ``question`` about ``state`` (with ``scale``: for a score from 0 to
    ``scale`` and what to improve); raise LLMNotConfigured or LLMCallFailed. ``timeout`` (seconds)
    bounds connecting, sending and each read; ``client`` is reused when given."""
    import httpx  # here, not at the top: httpx (with the click and rich its CLI module imports)
    # is about 16 MB per process, paid only by processes that ask a model (docs/benchmarks.md)

    config = config or LLMConfig.from_env()
    if scale is None:
        messages = build_messages(question, state)
    else:
        messages = build_messages(question, state, instruction=score_instruction(scale), system=SCORE_PROMPT)
        max_tokens = max(max_tokens, SCORE_REPLY_TOKENS)
    call = _Call(config)
    payload = {"model": config.model, "messages": [m.model_dump() for m in messages],
               "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    try:
        if client is None:
            with httpx.Client() as own:
                response = own.post(config.url, json=payload, headers=call.headers, timeout=timeout)
        else:
            response = client.post(config.url, json=payload, headers=call.headers, timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise call.unsent(exc, timeout) from exc
    latency = time.perf_counter() - started
    status = response.status_code
    if status >= 400:
        raise call.refused(status, response.text)
    try:
        body = response.json()
        reply = body["choices"][0]["message"]["content"]
        if not isinstance(reply, str):
            raise TypeError(f"content is {type(reply).__name__}, not a string")
    except (ValueError, LookupError, TypeError) as exc:
        raise call.malformed(exc, response.text, status) from exc
    return LLMVerdict(question=question, messages=messages, reply=reply, affirmative=is_affirmative(reply),
                      usage=parse_usage(body), model=config.model, latency_s=round(latency, 6))


class ChatStream:
    """A reply streamed token by token (``stream_chat``): iterate it for the pieces of text as the
    endpoint sends them (``"stream": true``: server-sent ``data:`` lines, ``[DONE]`` last); once it
    is read, ``usage`` holds what the endpoint reported (``stream_options.include_usage``; zeros
    when it reports nothing). Iterating it again raises."""

    def __init__(self, messages: list[Message], config: LLMConfig, timeout: float, client: httpx.Client | None,
                 max_tokens: int) -> None:
        self.messages = messages
        self.config = config
        self.timeout = timeout
        self.client = client
        self.max_tokens = max_tokens
        self.usage = LLMUsage()
        self._started = False

    def __iter__(self) -> Iterator[str]:
        import httpx

        if self._started:
            raise RuntimeError("a ChatStream is read once: call stream_chat again for another reply")
        self._started = True
        call = _Call(self.config)
        payload = {"model": self.config.model, "messages": [m.model_dump() for m in self.messages],
                   "max_tokens": self.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with contextlib.ExitStack() as stack:
                client = self.client or stack.enter_context(httpx.Client())
                response = stack.enter_context(client.stream("POST", self.config.url, json=payload,
                                                             headers=call.headers, timeout=self.timeout))
                if response.status_code >= 400:
                    raise call.refused(response.status_code, response.read().decode("utf-8", "replace"))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue  # blank lines between events, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield from self._pieces(call, data, response.status_code)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise call.unsent(exc, self.timeout) from exc

    def _pieces(self, call: _Call, data: str, status: int) -> Iterator[str]:
        """The text of one ``data:`` line (none for a line that only reports usage)."""
        try:
            body = json.loads(data)
            if body.get("usage"):
                self.usage = parse_usage(body)
            for choice in body.get("choices") or ():
                content = choice.get("delta", {}).get("content")
                if content is not None and not isinstance(content, str):
                    raise TypeError(f"delta content is {type(content).__name__}, not a string")
                if content:
                    yield content
        except (ValueError, AttributeError, TypeError) as exc:
            raise call.malformed(exc, data, status) from exc


def stream_chat(prompt: str, *, system: str | None = None, config: LLMConfig | None = None,
                timeout: float = DEFAULT_TIMEOUT_S, client: httpx.Client | None = None,
                max_tokens: int = 1024) -> ChatStream:
    """Ask the model for a reply to ``prompt`` in its streaming mode: a ``ChatStream`` to iterate for
    the reply's pieces as they come (what a callback passes to ``ctx.stream``). Raises
    LLMNotConfigured now, LLMCallFailed while it is read; ``timeout`` bounds connecting and each
    read (not the whole reply)."""
    messages = ([Message(role="system", content=system)] if system else []) + [Message(role="user", content=prompt)]
    return ChatStream(messages, config or LLMConfig.from_env(), timeout, client, max_tokens)
