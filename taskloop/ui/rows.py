"""The rows of a run page that do not change once written: a loop's finished rounds and the
events of the timeline. Each is rendered on its own (the macros of ``_rows.html``);
a live page keeps what it rendered (``Rows`` with a cache, one per open stream), so that each
update renders only the header, the graph, the rounds still going and the new events. A 40-round
loop's page took 7.4 ms to render whole; an update of it renders a small part of that.

A round is kept once its check is recorded (nothing in it changes after that) and only for the
same page state: whether its loop shows a Score column, whether the run has ended (the fork forms
appear then), read-only or not, and the user (their action token is in those forms)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jinja2 import Environment
from markupsafe import Markup

from taskloop.core.events import Event
from taskloop.runtime.models import RoundView, TaskView
from taskloop.ui.present import scored

KEEP = 5_000  # rows kept per open page; past it the oldest are rendered again when needed


class Rows:
    """Renders the rows of one page (``cache``: a dict kept across the renders of one live stream)."""

    def __init__(self, env: Environment, context: dict[str, Any], cache: dict[Any, Markup] | None = None) -> None:
        self.context = context
        self.cache: dict[Any, Markup] = {} if cache is None else cache
        self._macros: Any = None
        self._env = env

    @property
    def macros(self) -> Any:
        """``_rows.html`` as a module, made once per page render (its macros see the page's context)."""
        if self._macros is None and "m" in self.context:
            self._macros = self._env.get_template("_rows.html").make_module(vars=self.context)
        return self._macros

    def _kept(self, key: Any, render: Callable[[], str]) -> Markup:
        found = self.cache.get(key)
        if found is None:
            found = Markup(render())
            if len(self.cache) >= KEEP:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = found
        return found

    def round_row(self, task: TaskView, row: RoundView) -> Markup:
        def render() -> str:
            return str(self.macros.round_row(task, row))

        if row.check is None:  # still going: it changes
            return Markup(render())
        m = self.context["m"]
        return self._kept(("round", task.key, row.round, m.terminal, self.context["read_only"],
                           self.context["user"], scored(task.rounds)), render)

    def event_row(self, event: Event) -> Markup:
        def render() -> str:
            return str(self.macros.event_row(event))

        if event.id is None:
            return Markup(render())
        return self._kept(("event", event.id), render)
