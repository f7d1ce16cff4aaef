"""A run's workflow as a drawing: nodes in columns by depth, edges between them, each node
coloured by its task's live status (pure: the page's template turns it into inline SVG, so
there is no script and no layout library to ship).

A DAG workflow is drawn from its ``after`` edges, a graph workflow from its declared
transitions (loops included: an edge back to an earlier column is drawn underneath), each step
showing its latest activation. Without the definition's shape (it was never published, or
expired) the tasks are drawn without edges."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from taskloop.ui.present import counted, status_class

NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 168, 46, 56, 14, 12
MAX_NODES = 2_000  # beyond this the page lists tasks without a drawing
LABEL_CHARS = 22


@dataclass(frozen=True)
class Node:
    key: str
    label: str
    sub: str
    status: str
    x: int
    y: int
    cls: str

    @property
    def w(self) -> int:
        return NODE_W

    @property
    def h(self) -> int:
        return NODE_H


@dataclass(frozen=True)
class Edge:
    path: str
    back: bool = False


@dataclass
class Drawing:
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    width: int = 0
    height: int = 0
    omitted: int = 0  # tasks not drawn (more than MAX_NODES)


@dataclass(frozen=True)
class TaskState:
    """What a node shows of its task: status, and a loop's round of how many."""

    status: str
    kind: str
    round: int = 0
    max_rounds: int | None = None
    activations: int = 0


def draw(shape: Mapping[str, Any] | None, tasks: Mapping[str, TaskState],
         steps: Mapping[str, TaskState] | None = None) -> Drawing:
    """The drawing of a run: ``tasks`` by key (a DAG's), ``steps`` by step name (a graph workflow's
    latest activation of each step)."""
    if shape is not None and shape.get("graph"):
        graph = shape["graph"]
        names = ["start", *sorted(graph["steps"])]
        edges = [("start", graph["entry"]), *(tuple(pair) for pair in graph["transitions"])]
        kinds = {name: spec.get("kind", "task") for name, spec in graph["steps"].items()}
        limits = {name: spec.get("max_rounds") for name, spec in graph["steps"].items()}
        states = {"start": TaskState(status="done", kind="start"), **(steps or {})}
        return _layout(names, edges, states, kinds, limits, roots=["start"])
    if shape is not None:
        described = shape.get("tasks", [])
        names = [t["key"] for t in described]
        edges = [(dep, t["key"]) for t in described for dep in t.get("after", [])]
        kinds = {t["key"]: t.get("kind", "task") for t in described}
        limits = {t["key"]: t.get("max_rounds") for t in described}
        extra = [key for key in tasks if key not in kinds]  # graph actions, or a definition that moved on
        return _layout([*names, *extra], edges, tasks, kinds, limits, roots=None)
    return _layout(list(tasks), [], tasks, {k: t.kind for k, t in tasks.items()}, {}, roots=None)


def _layout(names: Sequence[str], edges: Sequence[tuple[str, str]], states: Mapping[str, TaskState],
            kinds: Mapping[str, str], limits: Mapping[str, int | None], roots: Sequence[str] | None) -> Drawing:
    omitted = max(0, len(names) - MAX_NODES)
    names = list(names[:MAX_NODES])
    known = set(names)
    edges = [(a, b) for a, b in edges if a in known and b in known]
    parents: dict[str, list[str]] = {name: [] for name in names}
    children: dict[str, list[str]] = {name: [] for name in names}
    for a, b in edges:
        children[a].append(b)
        parents[b].append(a)
    depth = _depths(names, parents, children, roots)
    columns: dict[int, list[str]] = {}
    for name in names:
        columns.setdefault(depth[name], []).append(name)
    order = {name: i for i, name in enumerate(names)}
    row: dict[str, float] = {}
    for col in sorted(columns):  # one barycentre pass: a node sits near its parents
        members = columns[col]
        for i, name in enumerate(members):
            placed = [row[p] for p in parents[name] if p in row and depth[p] < col]
            row[name] = sum(placed) / len(placed) if placed else float(i)
        members.sort(key=lambda n: (row[n], order[n]))
        for i, name in enumerate(members):
            row[name] = float(i)
    drawing = Drawing(omitted=omitted)
    position: dict[str, tuple[int, int]] = {}
    for col, members in columns.items():
        for i, name in enumerate(members):
            x, y = PAD + col * (NODE_W + GAP_X), PAD + i * (NODE_H + GAP_Y)
            position[name] = (x, y)
            state = states.get(name)
            status = state.status if state else "waiting"
            drawing.nodes.append(Node(key=name, label=_label(name), sub=_sub(kinds.get(name, "task"), state,
                                                                            limits.get(name)),
                                      status=status, x=x, y=y, cls=status_class(status)))
    for a, b in edges:
        (x1, y1), (x2, y2) = position[a], position[b]
        if depth[b] > depth[a]:
            sx, sy, tx, ty = x1 + NODE_W, y1 + NODE_H // 2, x2, y2 + NODE_H // 2
            bend = max(20, (tx - sx) // 2)
            drawing.edges.append(Edge(f"M{sx},{sy} C{sx + bend},{sy} {tx - bend},{ty} {tx},{ty}"))
        else:  # a loop back (graph workflows): under the nodes, from the bottom of one to the other
            sx, sy, tx, ty = x1 + NODE_W // 2, y1 + NODE_H, x2 + NODE_W // 2, y2 + NODE_H
            dip = max(sy, ty) + GAP_Y + 10
            drawing.edges.append(Edge(f"M{sx},{sy} C{sx},{dip} {tx},{dip} {tx},{ty}", back=True))
    drawing.width = PAD * 2 + (max(columns, default=0) + 1) * (NODE_W + GAP_X) - GAP_X
    tallest = max((len(m) for m in columns.values()), default=0)
    drawing.height = PAD * 2 + tallest * (NODE_H + GAP_Y) + (GAP_Y + 12 if any(e.back for e in drawing.edges) else 0)
    return drawing


def _depths(names: Sequence[str], parents: Mapping[str, list[str]], children: Mapping[str, list[str]],
            roots: Sequence[str] | None) -> dict[str, int]:
    """A DAG: the longest path from a root (``names`` is in dependency order). A graph with loops
    (``roots`` given): the shortest distance from the roots, breadth first; unreachable nodes last."""
    depth: dict[str, int] = {}
    if roots is None:
        for name in names:
            depth[name] = 1 + max((depth[p] for p in parents[name] if p in depth), default=-1)
        return depth
    frontier = [r for r in roots if r in children]
    for r in frontier:
        depth[r] = 0
    while frontier:
        following: list[str] = []
        for name in frontier:
            for child in children[name]:
                if child not in depth:
                    depth[child] = depth[name] + 1
                    following.append(child)
        frontier = following
    last = max(depth.values(), default=-1) + 1
    return {name: depth.get(name, last) for name in names}


def _label(key: str) -> str:
    return key if len(key) <= LABEL_CHARS else key[: LABEL_CHARS - 1] + "…"


def _sub(kind: str, state: TaskState | None, declared_rounds: int | None) -> str:
    status = state.status if state else "waiting"
    if kind == "start":
        return ""
    if kind == "loop":
        limit = (state.max_rounds if state else None) or declared_rounds
        shown_round = state.round if state else 0
        return f"loop · round {shown_round}/{limit} · {status}" if limit else f"loop · round {shown_round} · {status}"
    if state is not None and state.activations > 1:
        return f"{kind} · {counted(state.activations, 'activation')} · {status}"
    return f"{kind} · {status}"
