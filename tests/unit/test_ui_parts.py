"""The UI's pure parts: the graph layout, what values look like on a page, the auth header, the
cross-site check, the action tokens, SSE framing, and the address check (no server, no Redis)."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest

from taskloop.core.events import Event
from taskloop.ui import graph, live, present, security, serve


def _dag(*tasks: tuple[str, list[str], str]) -> dict:
    return {"tasks": [{"key": key, "after": after, "kind": kind, "max_rounds": 3 if kind == "loop" else None}
                      for key, after, kind in tasks]}


def test_a_dag_is_drawn_in_columns_by_longest_path_with_an_edge_per_dependency() -> None:
    shape = _dag(("a", [], "task"), ("b", ["a"], "loop"), ("c", ["a", "b"], "task"), ("d", [], "task"))
    states = {"a": graph.TaskState("done", "task"), "b": graph.TaskState("active", "loop", round=2, max_rounds=3)}
    drawing = graph.draw(shape, states)
    x = {n.key: n.x for n in drawing.nodes}
    assert x["a"] == x["d"] < x["b"] < x["c"]  # c waits for b, so it sits after it, not beside it
    assert len(drawing.edges) == 3 and not any(e.back for e in drawing.edges)
    nodes = {n.key: n for n in drawing.nodes}
    assert nodes["b"].sub == "loop · round 2/3 · active" and nodes["b"].cls == "live"
    assert nodes["c"].status == "waiting" and nodes["a"].cls == "ok"
    assert drawing.width >= max(n.x + n.w for n in drawing.nodes)
    assert drawing.height >= max(n.y + n.h for n in drawing.nodes)


def test_a_graph_workflow_draws_its_declared_loop_as_an_edge_back() -> None:
    shape = {"graph": {"entry": "write", "steps": {"write": {"kind": "task"}, "review": {"kind": "task"}},
                       "transitions": [["write", "review"], ["review", "write"]]}}
    drawing = graph.draw(shape, {}, {"write": graph.TaskState("done", "task", activations=2)})
    assert [n.key for n in sorted(drawing.nodes, key=lambda n: n.x)] == ["start", "write", "review"]
    assert [e.back for e in drawing.edges].count(True) == 1
    assert {n.key: n.sub for n in drawing.nodes}["write"] == "task · 2 activations · done"


def test_without_a_shape_the_tasks_are_drawn_without_edges_and_a_huge_run_is_cut() -> None:
    drawing = graph.draw(None, {"x": graph.TaskState("failed", "task")})
    assert [n.key for n in drawing.nodes] == ["x"] and drawing.edges == [] and drawing.nodes[0].cls == "bad"
    big = _dag(*((f"t{i}", [], "task") for i in range(graph.MAX_NODES + 5)))
    assert graph.draw(big, {}).omitted == 5


def test_a_long_key_is_cut_on_its_node_but_kept_as_its_key() -> None:
    drawing = graph.draw(_dag(("k" * 40, [], "task")), {})
    assert drawing.nodes[0].label == "k" * 21 + "…" and drawing.nodes[0].key == "k" * 40


@pytest.mark.parametrize(("seconds", "shown"), [(None, "-"), (0.35, "350 ms"), (1.234, "1.2 s"), (42, "42 s"),
                                                (185, "3 min 5 s"), (7440, "2 h 4 min"), (200_000, "2 d 7 h"),
                                                (-1, "0 ms")])
def test_durations_read_like_a_person_says_them(seconds: float | None, shown: str) -> None:
    assert present.duration(seconds) == shown


def test_values_on_a_page_keep_their_lines_but_no_control_or_bidi_character() -> None:
    text = "line 1\nline 2\t\x1b[31mred\u202eevil\x07"
    assert present.as_text(text) == "line 1\nline 2\t\\x1b[31mred\\u202eevil\\x07"
    assert present.as_text({"a": [1, "é"]}) == '{\n  "a": [\n    1,\n    "é"\n  ]\n}'
    assert present.one_line("a\n\nb   c") == "a b c"
    assert present.one_line("x" * 500, 10) == "x" * 9 + "…"
    assert present.is_long("x" * (present.LONG_CHARS + 1)) and not present.is_long("short")
    assert present.is_long("\n".join(["l"] * (present.LONG_LINES + 1)))
    assert not present.is_long("\n".join(["l"] * present.LONG_LINES))
    # a filter never returns markup: whatever it returns, the template escapes
    assert type(present.as_text("<b>")) is str and type(present.plain("<b>")) is str


def test_an_event_reads_as_a_few_words() -> None:
    complete = Event(type="phase", key="draft", round=1, phase="complete", at=1.0,
                     data={"done": False, "feedback": "cite\na source", "exec": {"worker": "w1", "took": 0.25,
                                                                               "wait": 0.01, "execs": 2}})
    assert present.event_details(complete) == "rejected: cite a source · on w1, took 250 ms, waited 10 ms, execution 2"
    cancel = Event(type="run.cancel", at=1.0, data={"reason": "wrong topic", "actor": "bob"})
    assert present.event_details(cancel) == "“wrong topic” · by bob"
    stopped = Event(type="task", key="a", at=1.0, data={"status": "cancelled", "reason": "cancelled"})
    assert present.event_details(stopped) == "cancelled"  # not "cancelled · cancelled"
    other = Event(type="transition", key="a@1", at=1.0, data={"next": ["b"]})
    assert present.event_details(other) == '{"next": ["b"]}'


def test_counts_controls_and_notices_read_as_words() -> None:
    assert [present.counted(n, "task") for n in (0, 1, 2)] == ["0 tasks", "1 task", "2 tasks"]
    assert present.counted(1, "attempt") == "1 attempt" and present.counted(3, "box", "boxes") == "3 boxes"
    assert present.control_text("cancel:changed my mind") == "cancelled: changed my mind"
    assert present.control_text("cancel:") == present.control_text("cancel:cancelled") == "cancelled"
    assert present.control_text("stop:failed") == "stopped after a failure"
    assert present.control_text("stop:budget") == "stopped: budget" and present.control_text(None) == ""
    assert present.done_notice("cancel") is not None and present.done_notice("nope") is None
    assert present.done_notice(None) is None


def _run_view(**fields: object) -> object:
    from taskloop.runtime.models import RunView

    base: dict[str, object] = {"run_id": "r-1", "workflow": "essay", "version": "", "status": "failed",
                               "created_at": 1.0, "finished_at": 2.0, "usage": {}, "tasks": {}}
    return RunView.model_validate({**base, **fields})


def _run_body(run: object, **context: object) -> str:
    """_run_body.html rendered as the app renders it (taskloop/ui/app.py), for a run read by hand."""
    from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

    from taskloop.ui import charts, pages
    from taskloop.ui.rows import Rows

    env = Environment(loader=PackageLoader("taskloop.ui", "templates"), autoescape=select_autoescape(default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(present.FILTERS)
    env.globals.update(ago=present.ago, took=present.took, score_chart=charts.score_chart)
    model = pages.RunModel(run=run, shape=None, drawing=graph.draw(None, {}), events=[], events_total=0,  # type: ignore[arg-type]
                           last_entry="0-0", gates=[], budget=None, activations=[],
                           loops=[t for t in run.tasks.values() if t.kind == "loop"],  # type: ignore[attr-defined]
                           others=[t for t in run.tasks.values() if t.kind != "loop"], now=3.0)  # type: ignore[attr-defined]
    base = {"read_only": False, "user": "", "csrf": "t", "auth": False, "version": "x", "notice": None, "m": model,
            **context}
    rows = Rows(env, base)
    return env.get_template("_run_body.html").render(**base, round_row=rows.round_row, event_row=rows.event_row)


def test_the_run_page_shows_its_input_escaped_and_no_bare_v_for_an_empty_version() -> None:
    html = _run_body(_run_view(input={"topic": "<script>x</script>", "n": 1}, status="running", finished_at=None))
    assert 'section class="card input"' in html and "&lt;script&gt;x&lt;/script&gt;" in html and "<script>x" not in html
    assert ',\n  &#34;n&#34;: 1\n}' in html  # pretty JSON, one key a line
    assert "<b>essay</b></span>" in html and " v<" not in html
    assert "v2" in _run_body(_run_view(version="2"))
    assert 'section class="card input"' not in _run_body(_run_view())  # no input: no section
    long = _run_body(_run_view(input={"text": "x" * (present.LONG_CHARS + 10)}))
    assert '<details id="run-input">' in long  # folded


def test_a_loop_shows_a_score_column_only_when_a_round_has_a_score_and_labels_the_forks_feedback() -> None:
    def loop(*checks: dict, given: str | None = None) -> dict:
        rounds = [{"round": i + 1, "phase": "complete", "output": f"draft {i + 1}", "check": c,
                   "feedback_given": given if i == 0 else None} for i, c in enumerate(checks)]
        return {"draft": {"key": "draft", "kind": "loop", "status": "done", "round": len(rounds), "attempts": 1,
                          "rounds": rounds, "started_at": 1.0, "finished_at": 2.0}}

    plain = _run_body(_run_view(status="done", tasks=loop({"done": True, "feedback": "fine"})))
    assert "<th>Score</th>" not in plain and "1 attempt ·" in plain
    scored = _run_body(_run_view(status="done", tasks=loop({"done": False, "score": 0.4}, {"done": True})))
    assert "<th>Score</th>" in scored and "<td>0.4</td>" in scored
    forked = _run_body(_run_view(status="done", tasks=loop({"done": True, "feedback": "ok now"}, given="<i>shorter")))
    assert "given by the fork</span> <q>&lt;i&gt;shorter</q>" in forked
    assert "the check's feedback</span><pre class=\"text\">ok now" in forked
    assert "fed by the fork" not in forked


def test_a_failed_run_is_offered_a_resume_unless_its_workflow_was_never_registered() -> None:
    def failed(kind: str) -> object:
        return _run_view(tasks={"fix": {"key": "fix", "kind": "task", "status": "failed",
                                        "error": {"key": "fix", "type": kind, "message": "broken"}}})

    assert 'id="resume-run"' in _run_body(failed("ValueError")) and present.resume_note(failed("ValueError")) is None
    html = _run_body(failed("WorkflowNotRegistered"))  # a step failed so: it replays once the workers import it
    assert 'id="resume-run"' in html and 'id="resume-note"' in html and "fails again" in html
    unknown = _run_view(error={"key": "", "type": "WorkflowNotRegistered", "message": "no workflow essay"})
    html = _run_body(unknown)  # no step ran: nothing to replay, ever
    assert 'id="resume-run"' not in html and "no worker imports its module" in html and "No resume" in html


def test_the_actions_are_labelled_and_cancelling_asks_first() -> None:
    html = _run_body(_run_view(status="running", finished_at=None, control=None))
    assert "<label>Your name <input" in html and "<label>Reason <input" in html
    assert 'data-confirm="Cancel run r-1?' in html
    task = {"key": "a", "kind": "task", "status": "cancelled", "reason": "cancelled"}
    stopped = _run_body(_run_view(status="cancelled", control="cancel:changed my mind", tasks={"a": task}))
    assert "cancelled: changed my mind" in stopped and "cancel:" not in stopped
    assert 'id="task-a"' in stopped and "<small>cancelled</small>" not in stopped  # a reason = its status: once
    assert "stopped after a failure" in _run_body(_run_view(control="stop:failed"))


def test_credentials_are_user_colon_password_and_the_password_may_hold_colons() -> None:
    assert security.Credentials.parse("ops:s3:cret") == security.Credentials("ops", "s3:cret")
    for bad in ("ops", ":pw", "ops:", ""):
        with pytest.raises(ValueError, match="TASKLOOP_UI_AUTH must be user:password"):
            security.Credentials.parse(bad)


def _call(guard: security.Guard, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict[bytes, bytes]]:
    sent: list[dict] = []
    reached: list[str] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        reached.append(scope["state"].get("user", ""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard.app = app

    async def receive() -> dict:
        return {"type": "http.request"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": headers, "state": {}}
    # a thread of its own: a browser test in the same session may hold this thread's event loop
    runner = threading.Thread(target=lambda: asyncio.run(guard(scope, receive, send)))  # type: ignore[arg-type]
    runner.start()
    runner.join()
    return sent[0]["status"], dict(sent[0]["headers"])


def test_the_guard_asks_for_credentials_everywhere_but_the_health_probe_and_sets_headers() -> None:
    guard = security.Guard(lambda *a: None, security.Credentials("ops", "pw"))  # type: ignore[arg-type,return-value]
    good = b"Basic " + base64.b64encode(b"ops:pw")
    status, headers = _call(guard, "/static/ui.css", [])
    assert status == 401 and headers[b"www-authenticate"].startswith(b'Basic realm="taskloop"')
    assert headers[b"x-frame-options"] == b"DENY"  # a refusal carries the headers too
    for header in (b"Basic " + base64.b64encode(b"ops:nope"), b"Basic !!!", b"Bearer abc", good.lower()):
        assert _call(guard, "/", [(b"authorization", header)])[0] == 401
    status, headers = _call(guard, "/", [(b"authorization", good)])
    assert status == 200 and b"script-src 'self'" in headers[b"content-security-policy"]
    assert _call(guard, "/healthz", [])[0] == 200


@pytest.mark.parametrize(("headers", "refused"), [
    ({}, False),  # an API client: no origin, must still carry the token
    ({"origin": "http://ui.local:8188"}, False),
    ({"referer": "http://ui.local:8188/runs/x"}, False),
    ({"origin": "http://evil.example"}, True),
    ({"origin": "null"}, True),
    ({"origin": "https://ui.local:8188"}, True),  # another scheme is another origin
    ({"referer": "http://ui.local:9999/"}, True),
])
def test_the_cross_site_check_compares_the_whole_origin(headers: dict[str, str], refused: bool) -> None:
    assert (security.cross_site(headers, "http", "ui.local:8188") is not None) is refused


def test_tokens_are_per_user_under_the_secret_and_compared_whole() -> None:
    tokens = security.Tokens(b"secret")
    assert tokens.valid("ops", tokens.token("ops")) and not tokens.valid("eve", tokens.token("ops"))
    assert not tokens.valid("ops", None) and not tokens.valid("ops", tokens.token("ops")[:-1])
    assert security.Tokens(b"other").token("ops") != tokens.token("ops")


def test_an_sse_message_frames_every_line() -> None:
    assert live.message("run", "<p>a</p>\n<p>b</p>") == "event: run\ndata: <p>a</p>\ndata: <p>b</p>\n\n"


def test_only_a_loopback_address_may_go_without_auth() -> None:
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.5"):
        serve.check_exposure(host, None, False)
    for host in ("0.0.0.0", "192.168.1.4", "example.com", "::"):
        with pytest.raises(serve.UIRefused, match="without authentication"):
            serve.check_exposure(host, None, False)
        serve.check_exposure(host, security.Credentials("a", "b"), False)
        serve.check_exposure(host, None, True)


def test_a_live_page_renders_a_finished_round_and_an_event_once_and_a_round_going_on_every_time() -> None:
    from types import SimpleNamespace

    from taskloop.ui.rows import Rows

    calls: list[str] = []

    class Counted(Rows):
        @property
        def macros(self) -> object:
            return SimpleNamespace(round_row=lambda t, rd: calls.append(f"r{rd.round}") or f"<tr>{rd.round}</tr>",
                                   event_row=lambda e: calls.append(e.id) or f"<tr>{e.id}</tr>")

    cache: dict = {}
    done, going = SimpleNamespace(round=1, check={"done": False}), SimpleNamespace(round=2, check=None)
    task = SimpleNamespace(key="draft", rounds=[done, going])
    event = Event(type="phase", at=1.0, id="1-0:0")
    for _ in range(3):  # three renders of one live page
        context = {"m": SimpleNamespace(terminal=False), "read_only": True, "user": "ann"}
        rows = Counted(None, context, cache)  # type: ignore[arg-type]
        assert rows.round_row(task, done) == "<tr>1</tr>" and rows.round_row(task, going) == "<tr>2</tr>"  # type: ignore[arg-type]
        assert rows.event_row(event) == "<tr>1-0:0</tr>"
    assert calls == ["r1", "r2", "1-0:0", "r2", "r2"]
    # once the run has ended its rounds show fork forms: the page renders them again, once
    rows = Counted(None, {"m": SimpleNamespace(terminal=True), "read_only": False, "user": "ann"}, cache)  # type: ignore[arg-type]
    rows.round_row(task, done)  # type: ignore[arg-type]
    rows.round_row(task, done)  # type: ignore[arg-type]
    assert calls[-1] == "r1" and calls.count("r1") == 2
