"""The run UI as an ASGI app (Starlette): pages rendered on the server from Jinja2 templates, live
updates over server-sent events (htmx swaps them in), the same data as JSON under ``/api/``, and
the actions as POSTs. ``create_app`` builds it over a client; ``taskloop ui`` serves it
(taskloop/ui/serve.py). Routes, and what each one reads, are listed in docs/ui.md.

Every read goes through the client's read API; the only writes are the client's actions
(cancel, resume, decide, fork), each recorded with its actor: the authenticated user, or, without
auth, the name given in the form (default ``ui``). A UI without the workflows' code has a worker
carry them out (runtime/acting.py): its refusals come back as the same errors, and no worker in
time is ActionTimeout (504)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any

import anyio.to_thread
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from taskloop.base import names
from taskloop.base.errors import (
    ActionRefused,
    ActionTimeout,
    GateRefused,
    IncompatibleDefinition,
    InvalidInput,
    NotForkable,
    NotResumable,
    RunExists,
    RunNotFound,
    StoreUnavailable,
    TaskLoopError,
    WorkflowNotRegistered,
)
from taskloop.base.text import page_text
from taskloop.core.events import Event
from taskloop.runtime import streaming
from taskloop.runtime.client import TaskLoop
from taskloop.ui import charts, pages, present
from taskloop.ui.live import Streams, run_stream, text_stream
from taskloop.ui.present import FILTERS
from taskloop.ui.rows import Rows
from taskloop.ui.security import Credentials, Guard, Tokens, cross_site

PAGE_SIZE = 50
DEFAULT_ACTOR = "ui"
try:
    VERSION = metadata.version("taskloop")
except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without its metadata
    VERSION = "unknown"


@dataclass
class UI:
    client: TaskLoop
    read_only: bool
    credentials: Credentials | None
    tokens: Tokens
    streams: Streams
    fleet: pages.FleetCache
    env: Environment

    def user(self, request: Request) -> str:
        return str(request.scope.get("state", {}).get("user") or "")

    def render(self, name: str, request: Request, status: int = 200, **context: Any) -> HTMLResponse:
        html = self.fragment(name, self.user(request), **context)
        return HTMLResponse(html, status_code=status, headers={"cache-control": "no-store"})

    def fragment(self, name: str, user: str, rows: dict[Any, Any] | None = None, **context: Any) -> str:
        """A template rendered for ``user`` (their action token goes into its forms). ``rows``: the
        rows a live page keeps between its renders (taskloop/ui/rows.py)."""
        base = dict(read_only=self.read_only, user=user, csrf=self.tokens.token(user),
                    auth=self.credentials is not None, version=VERSION, **context)
        kept = Rows(self.env, base, rows)
        return self.env.get_template(name).render(**base, round_row=kept.round_row, event_row=kept.event_row)


def create_app(client: TaskLoop, *, read_only: bool = False, credentials: Credentials | None = None,
               max_streams: int = 64, tokens: Tokens | None = None) -> Guard:
    env = Environment(loader=PackageLoader("taskloop.ui", "templates"), autoescape=select_autoescape(default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(FILTERS)
    env.globals.update(ago=present.ago, took=present.took, score_chart=charts.score_chart)
    ui = UI(client=client, read_only=read_only, credentials=credentials, tokens=tokens or Tokens(),
            streams=Streams(max_streams), fleet=pages.FleetCache(client), env=env)

    def page(handler: Callable[[UI, Request], Response]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:  # a sync endpoint: Starlette runs it in a thread
            try:
                return handler(ui, request)
            except TaskLoopError as exc:
                status, kind = _status_of(exc)
                if request.url.path.startswith("/api/"):
                    return JSONResponse({"error": {"type": kind, "message": str(exc)}}, status_code=status)
                return ui.render("error.html", request, status=status, title=kind, message=str(exc))
        return endpoint

    routes = [
        Route("/", page(runs_page)),
        Route("/fragments/runs", page(runs_fragment)),
        Route("/runs/{run_id}", page(run_page)),
        Route("/runs/{run_id}/body", page(run_body)),
        Route("/runs/{run_id}/live", live_endpoint(ui)),
        Route("/runs/{run_id}/cancel", page(cancel_form), methods=["POST"]),
        Route("/runs/{run_id}/resume", page(resume_form), methods=["POST"]),
        Route("/runs/{run_id}/gates/{key}", page(decide_form), methods=["POST"]),
        Route("/runs/{run_id}/fork", page(fork_form), methods=["POST"]),
        Route("/fleet", page(fleet_page)),
        Route("/fragments/fleet", page(fleet_fragment)),
        Route("/api/session", page(api_session)),
        Route("/api/runs", page(api_runs)),
        Route("/api/runs/{run_id}", page(api_run)),
        Route("/api/runs/{run_id}/events", page(api_events)),
        Route("/api/runs/{run_id}/stream", stream_endpoint(ui)),
        Route("/api/fleet", page(api_fleet)),
        Route("/api/runs/{run_id}/cancel", page(api_cancel), methods=["POST"]),
        Route("/api/runs/{run_id}/resume", page(api_resume), methods=["POST"]),
        Route("/api/runs/{run_id}/gates/{key}", page(api_decide), methods=["POST"]),
        Route("/api/runs/{run_id}/fork", page(api_fork), methods=["POST"]),
        Route("/healthz", lambda request: PlainTextResponse("ok\n")),
        Mount("/static", StaticFiles(packages=[("taskloop.ui", "static")]), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error(ui)})
    app.state.ui = ui
    return Guard(app, credentials)


# --- reading ------------------------------------------------------------------------------------

def _runs(ui: UI, request: Request) -> pages.RunsModel:
    q = request.query_params
    prefix = (q.get("q") or "").strip() or None
    return pages.runs_model(ui.client, q.get("status") or None, q.get("workflow") or None, prefix,
                            _int(q.get("offset"), "offset", 0), _int(q.get("limit"), "limit", PAGE_SIZE))


def runs_page(ui: UI, request: Request) -> Response:
    return ui.render("runs.html", request, m=_runs(ui, request))


def runs_fragment(ui: UI, request: Request) -> Response:
    return ui.render("_runs_table.html", request, m=_runs(ui, request))


def run_page(ui: UI, request: Request, notice: str | None = None, status: int = 200) -> Response:
    model = pages.run_model(ui.client, _run_id(request))
    done = None if notice else present.done_notice(request.query_params.get("done")
                                                  or ("forked" if request.query_params.get("forked") else None))
    return ui.render("run.html", request, status=status, m=model, notice=notice, done=done)


def run_body(ui: UI, request: Request) -> Response:
    return ui.render("_run_body.html", request, m=pages.run_model(ui.client, _run_id(request)), notice=None)


def live_endpoint(ui: UI) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        run_id = _run_id(request)
        after = request.query_params.get("after") or "0-0"
        if not _entry_id(after):
            return PlainTextResponse("after must be a stream entry id (e.g. 1764460000000-0)\n", status_code=400)
        user = ui.user(request)
        rows: dict[Any, Any] = {}  # what this page rendered and keeps: its finished rounds and its events
        known: list[Event] = []  # the run's events read so far: each render reads the later ones

        def render() -> str:
            try:
                return ui.fragment("_run_body.html", user, rows, m=pages.run_model(ui.client, run_id, known),
                                   notice=None)
            except RunNotFound:
                return ui.fragment("_gone.html", user, run_id=run_id)

        stream = run_stream(ui.streams, ui.client.store, run_id, after, render)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})
    return endpoint


def stream_endpoint(ui: UI) -> Callable[[Request], Any]:
    """``/api/runs/<id>/stream``: the run's live text as server-sent events (``?task=``: one task's;
    ``?after=`` or ``Last-Event-ID``: after that chunk; ``?text=page``: the text as a page shows it,
    controls and bidi characters escaped as ``page_text`` does, which the run page asks for). The
    run and the arguments are checked first: an unknown run is a 404 and a bad argument a 400, as
    JSON like every /api route."""
    async def endpoint(request: Request) -> Response:
        query = request.query_params
        after = query.get("after") or request.headers.get("last-event-id") or None
        try:
            run_id = _run_id(request)
            if query.get("text", "raw") not in ("raw", "page"):
                raise InvalidInput("text must be raw (the text as streamed, the default) or page (escaped as the "
                                   "run page shows it)")
            found = await anyio.to_thread.run_sync(lambda: streaming.follow_idle(
                ui.client.store, run_id, query.get("task") or None, after))
        except TaskLoopError as exc:
            status, kind = _status_of(exc)
            return JSONResponse({"error": {"type": kind, "message": str(exc)}}, status_code=status)

        def ended() -> dict[str, object]:
            result = ui.client.result(run_id)
            return {"run_id": run_id, "status": result.status if result else None,
                    "termination": result.termination_code if result else None}

        chunks = found if query.get("text") != "page" else \
            (replace(c, text=page_text(c.text)) if c is not None else None for c in found)
        return StreamingResponse(text_stream(ui.streams, chunks, ended), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})
    return endpoint


def fleet_page(ui: UI, request: Request) -> Response:
    return ui.render("fleet.html", request, f=ui.fleet.get(), streams=ui.streams)


def fleet_fragment(ui: UI, request: Request) -> Response:
    return ui.render("_fleet_body.html", request, f=ui.fleet.get(), streams=ui.streams)


def api_session(ui: UI, request: Request) -> Response:
    user = ui.user(request)
    return JSONResponse({"user": user or None, "csrf": ui.tokens.token(user), "read_only": ui.read_only,
                         "version": VERSION})


def api_runs(ui: UI, request: Request) -> Response:
    model = _runs(ui, request)
    return JSONResponse({**model.page.model_dump(mode="json"),
                         "progress": {rid: [p.model_dump() for p in loops] for rid, loops in model.progress.items()}})


def api_run(ui: UI, request: Request) -> Response:
    model = pages.run_model(ui.client, _run_id(request))
    return JSONResponse({"run": model.run.model_dump(mode="json"), "shape": model.shape,
                         "last_entry": model.last_entry, "events": len(model.events)})


def api_events(ui: UI, request: Request) -> Response:
    after = request.query_params.get("after") or None
    found = ui.client.events(_run_id(request), after)
    return JSONResponse([e.model_dump(mode="json") for e in found])


def api_fleet(ui: UI, request: Request) -> Response:
    view = ui.fleet.get()
    return JSONResponse({**view.model_dump(mode="json"),
                         "ui": {"streams_open": ui.streams.open, "streams_limit": ui.streams.limit,
                                "streams_served": ui.streams.served}})


# --- acting -------------------------------------------------------------------------------------

def _guard_post(ui: UI, request: Request, token: str | None) -> None:
    if ui.read_only:
        raise ActionRefused(403, "this UI is read-only (taskloop ui --read-only): actions are turned off")
    problem = cross_site(request.headers, request.url.scheme, request.headers.get("host"))
    if problem is not None:
        raise ActionRefused(403, f"cross-site request refused: {problem}")
    if not ui.tokens.valid(ui.user(request), token):
        raise ActionRefused(403, "the action token is missing or wrong: reload the page (API clients: send the csrf of "
                           "GET /api/session as the X-CSRF-Token header)")


def _actor(ui: UI, request: Request, given: Any) -> str:
    """Who acts: the authenticated user; without auth, the name the form or body gives."""
    if ui.credentials is not None:
        return ui.user(request)
    if given is None or given == "":
        return DEFAULT_ACTOR
    if not isinstance(given, str):
        raise InvalidInput("actor must be a string (who acts)")
    return given.strip()[:200] or DEFAULT_ACTOR


def _form_action(handler: Callable[[UI, Request, dict[str, Any], str], str],
                 target: Callable[[Request, str], str] | None = None) -> Callable[[UI, Request], Response]:
    def endpoint(ui: UI, request: Request) -> Response:
        form = _run_async(request.form)
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        try:
            _guard_post(ui, request, fields.get("csrf"))
            actor = _actor(ui, request, fields.get("actor"))
            done = handler(ui, request, fields, actor)
        except ActionRefused as exc:
            return ui.render("error.html", request, status=exc.status, title="Refused", message=str(exc))
        except (InvalidInput, GateRefused, NotResumable, NotForkable, IncompatibleDefinition,
                WorkflowNotRegistered, RunExists, ActionTimeout) as exc:
            return run_page(ui, request, notice=f"{type(exc).__name__}: {exc}", status=_status_of(exc)[0])
        if target is not None:
            return RedirectResponse(target(request, done), status_code=303)
        return RedirectResponse(f"/runs/{_run_id(request)}?done={done}", status_code=303)
    return endpoint


def _api_action(handler: Callable[[UI, Request, dict[str, Any], str], str],
                new_run: bool = False) -> Callable[[UI, Request], Response]:
    def endpoint(ui: UI, request: Request) -> Response:
        try:
            raw = _run_async(request.body)
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ActionRefused(400, "the body must be a JSON object, e.g. {\"reason\": \"no longer needed\"}")
            _guard_post(ui, request, request.headers.get("x-csrf-token"))
            actor = _actor(ui, request, body.get("actor"))
            done = handler(ui, request, body, actor)
        except json.JSONDecodeError as exc:
            return JSONResponse({"error": {"type": "InvalidInput", "message": f"the body is not JSON: {exc}"}},
                                status_code=400)
        except ActionRefused as exc:
            return JSONResponse({"error": {"type": "Refused", "message": str(exc)}}, status_code=exc.status)
        if new_run:  # the action made a run: ``done`` is its id
            return JSONResponse({"ok": True, "run_id": done, "run": ui.client.inspect(done).model_dump(mode="json")})
        run = ui.client.inspect(_run_id(request))
        return JSONResponse({"ok": True, "done": done, "run": run.model_dump(mode="json")})
    return endpoint


def _cancel(ui: UI, request: Request, given: dict[str, Any], actor: str) -> str:
    reason = given.get("reason") or "cancelled from the UI"
    result = ui.client.cancel(_run_id(request), reason if isinstance(reason, str) else str(reason), actor)
    return "cancel" if result.cancelled else "nothing-to-cancel"


def _resume(ui: UI, request: Request, given: dict[str, Any], actor: str) -> str:
    ui.client.resume(_run_id(request), actor)
    return "resume"


def _decide(ui: UI, request: Request, given: dict[str, Any], actor: str) -> str:
    action = given.get("action")
    if action not in ("approve", "reject", "resume"):
        raise InvalidInput(f"action must be approve, reject or resume, got {page_text(str(action))[:40]!r}")
    value: Any = given.get("value")
    if isinstance(value, str) and given.get("value_format", "json") == "json":  # a form's text box holds JSON
        text = value.strip()
        try:
            value = json.loads(text) if text else None
        except json.JSONDecodeError as exc:
            raise InvalidInput(f'value must be JSON (a text in quotes: "My title"; a number: 3): {exc}') from None
    reason = given.get("reason") or ""
    ui.client.decide(_run_id(request), request.path_params["key"], action, actor,
                     reason if isinstance(reason, str) else str(reason), value)
    return str(action)


def _fork(ui: UI, request: Request, given: dict[str, Any], actor: str) -> str:
    """A fork (its actor is in the new run's first event); returns the new run's id."""
    task, round_text, feedback = given.get("task"), given.get("round"), given.get("feedback")
    round_number = round_text if isinstance(round_text, int) else _int(str(round_text or ""), "round", 0)
    if isinstance(feedback, str) and given.get("feedback_default") == "1" and feedback.strip() == "":
        feedback = None  # the form's box left empty: the recorded feedback
    handle = ui.client.fork(_run_id(request), str(task or ""), round_number, feedback, actor=actor)
    return handle.run_id


cancel_form, resume_form, decide_form = _form_action(_cancel), _form_action(_resume), _form_action(_decide)
fork_form = _form_action(_fork, lambda request, new_id: f"/runs/{new_id}?forked=1")
api_cancel, api_resume, api_decide = _api_action(_cancel), _api_action(_resume), _api_action(_decide)
api_fork = _api_action(_fork, new_run=True)


# --- helpers ------------------------------------------------------------------------------------

def _run_async(call: Callable[[], Any]) -> Any:
    """Await a request's body from the thread a sync endpoint runs in."""
    import anyio.from_thread

    return anyio.from_thread.run(call)


def _run_id(request: Request) -> str:
    run_id = request.path_params["run_id"]
    if not names.is_run_id(run_id):
        raise RunNotFound(run_id[:80])
    return str(run_id)


def _entry_id(text: str) -> bool:
    first, _, second = text.partition("-")
    return first.isdigit() and second.isdigit() and len(text) <= 40


def _int(text: str | None, what: str, default: int) -> int:
    if text is None or text == "":
        return default
    if not text.isdigit() or len(text) > 9:
        raise InvalidInput(f"{what} must be a whole number, got {page_text(text)[:40]!r}")
    return int(text)


def _status_of(exc: TaskLoopError) -> tuple[int, str]:
    if isinstance(exc, ActionRefused):
        return exc.status, "Refused"
    if isinstance(exc, RunNotFound):
        return 404, "RunNotFound"
    if isinstance(exc, StoreUnavailable):
        return 503, "StoreUnavailable"
    if isinstance(exc, InvalidInput):
        return 400, "InvalidInput"
    if isinstance(exc, ActionTimeout):  # no worker with the workflow's code answered (runtime/acting.py)
        return 504, "ActionTimeout"
    return 409, type(exc).__name__


def _http_error(ui: UI) -> Callable[[Request, Exception], Response]:
    def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if request.url.path.startswith(("/api/", "/static/")):
            return JSONResponse({"error": {"type": "HTTPError", "message": exc.detail}}, status_code=exc.status_code)
        return ui.render("error.html", request, status=exc.status_code, title=str(exc.status_code),
                         message=str(exc.detail))
    return handler
