"""A real OpenAI-compatible chat-completions server on 127.0.0.1, for the until_llm / llm_check tests.

It listens on a free loopback port (``ThreadingHTTPServer`` in a thread), records every request (path,
headers, JSON body) and answers ``POST /v1/chat/completions`` with scripted replies: content and usage, an
HTTP error status, a malformed body, or a delay (to run past a client's timeout). A request with
``"stream": true`` is answered in the streaming mode: server-sent ``data:`` lines, one chunk per word of the
content (``token_delay_s`` apart), the usage last when ``stream_options.include_usage`` asks for it, then
``data: [DONE]``. Nothing leaves loopback.

    llm_server = llm_server_fixture()          # in a test module (or conftest): a fixture named llm_server

    def test_x(llm_server):
        llm_server.script(Reply("yes"), Reply(status=500))
        ... base_url=llm_server.base_url ...
        llm_server.requests[0].body["messages"]

A ``ChatServer`` is also a context manager, for tests that need it outside a fixture (say, for real workers:
pass ``TASKLOOP_LLM_BASE_URL=server.base_url`` in their environment).
"""

from __future__ import annotations

import json
import re
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class Reply:
    """One scripted answer. ``status`` other than 200 answers an OpenAI-style error; ``body`` (text) replaces
    the whole response body (for malformed replies); ``delay_s`` waits before answering; ``token_delay_s``
    waits between the chunks of a streamed reply."""

    content: str | None = "yes"
    usage: dict[str, Any] | None = None
    status: int = 200
    body: str | None = None
    delay_s: float = 0.0
    token_delay_s: float = 0.0


@dataclass(frozen=True)
class Request:
    path: str
    headers: dict[str, str]  # names lowercased
    body: Any


@dataclass
class ChatServer:
    default: Reply = field(default_factory=Reply)  # answered once the script is used up
    requests: list[Request] = field(default_factory=list)
    _script: deque[Reply] = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _httpd: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._httpd is not None, "the server is not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def script(self, *replies: Reply) -> None:
        with self._lock:
            self._script.extend(replies)

    def _next(self, request: Request) -> Reply:
        with self._lock:
            self.requests.append(request)
            return self._script.popleft() if self._script else self.default

    def start(self) -> ChatServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body: Any = json.loads(raw)
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                reply = server._next(Request(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                if reply.delay_s and server._stopping.wait(reply.delay_s):
                    return
                if self.path != PATH:
                    self._send(404, json.dumps({"error": {"message": f"no route {self.path}", "type": "not_found"}}))
                elif reply.body is not None:
                    self._send(reply.status, reply.body)
                elif reply.status != 200:
                    self._send(reply.status, json.dumps({"error": {"message": "scripted failure", "type": "server"}}))
                elif isinstance(body, dict) and body.get("stream"):
                    self._stream(body, reply)
                else:
                    self._send(200, json.dumps(completion(body, reply)))

            def _stream(self, request: dict[str, Any], reply: Reply) -> None:
                """The streaming mode: one ``data:`` event per word, then the usage (if asked), then [DONE]
                (HTTP/1.0: the body ends when the connection closes)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for piece in re.findall(r"\s*\S+\s*", reply.content or ""):
                    chunk = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": request.get("model"),
                             "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    if reply.token_delay_s and server._stopping.wait(reply.token_delay_s):
                        return
                if (request.get("stream_options") or {}).get("include_usage"):
                    usage = completion(request, reply)["usage"]
                    self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def _send(self, status: int, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # keep the test output clean
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that timed out and hung up: nothing to report

        self._httpd = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), name="llm-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def completion(request: Any, reply: Reply) -> dict[str, Any]:
    model = request.get("model", "") if isinstance(request, dict) else ""
    usage = reply.usage if reply.usage is not None else {"prompt_tokens": 0, "completion_tokens": 0,
                                                         "total_tokens": 0}
    return {
        "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply.content}}],
        "usage": usage,
    }


def llm_server_fixture(name: str = "llm_server") -> Any:
    """A function-scoped pytest fixture ``name`` yielding a started ChatServer, stopped after the test.
    Assign it to a module-level name in a test module (or a conftest) to make it available."""

    @pytest.fixture(name=name)
    def fixture() -> Iterator[ChatServer]:
        with ChatServer() as server:
            yield server

    return fixture
