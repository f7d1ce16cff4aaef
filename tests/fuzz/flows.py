"""Workflows the fuzz tests run on real workers (imported by the test process and by the workers).

A check's return value cannot travel in a run input as it is (sets, objects, lone surrogates are
not JSON), so the input carries a *recipe* that ``build`` turns into the Python value, in the
worker as in the test (which predicts the outcome from the same value):

``{"json": v}`` v itself                 ``{"str": [cp, ...]}`` a str of those code points
``{"tuple": [r, ...]}`` a tuple          ``{"set": [int, ...]}`` a set
``{"bytes": "hex"}`` bytes               ``{"float": "nan"|"inf"|"-inf"|"-0.0"}``
``{"bigint": digits}`` 10**digits         ``{"object": null}`` an object JSON knows nothing of
``{"dict": [[rk, rv], ...]}`` a dict of built keys and values
``{"loopcheck": {"done": r, "feedback": r}}`` tl.LoopCheck(...) (which may itself raise)
``{"raise": r}`` raises ValueError(built message)
"""

from __future__ import annotations

from typing import Any

import taskloop as tl


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque>"


_UNSET = object()


def build(recipe: Any) -> Any:
    """The Python value a recipe stands for (see the module docstring)."""
    if not isinstance(recipe, dict) or len(recipe) != 1:
        raise TypeError(f"not a recipe: {recipe!r}")
    [(kind, arg)] = recipe.items()
    if kind == "json":
        return arg
    if kind == "str":
        return "".join(chr(cp) for cp in arg)
    if kind == "tuple":
        return tuple(build(r) for r in arg)
    if kind == "set":
        return set(arg)
    if kind == "bytes":
        return bytes.fromhex(arg)
    if kind == "float":
        return float(arg)
    if kind == "bigint":
        return 10**arg
    if kind == "object":
        return Opaque()
    if kind == "dict":
        return {build(k): build(v) for k, v in arg}
    if kind == "loopcheck":
        args = {name: build(r) for name, r in arg.items()}
        return tl.LoopCheck(**args)
    if kind == "raise":
        raise ValueError(build(arg))
    raise TypeError(f"unknown recipe {kind!r}")


# --- what a check returns -----------------------------------------------------------------------


def _candidate(ctx: tl.LoopContext, feedback: str | None) -> Any:
    return build(ctx.input.get("candidate", {"json": ctx.round}))


def _judge(ctx: tl.LoopContext, candidate: Any) -> Any:
    return build(ctx.input["check"])


judged = tl.define_loop_task("judged", max_rounds=2, attempt=_candidate, check=_judge)
CHECKS = tl.define_workflow("fuzz-checks", version="1", tasks=[judged])

# --- gates --------------------------------------------------------------------------------------

GATE_ACTORS = {"approval": ("alice", "bob"), "pause": (), "input": ("carol",)}


def _gated(kind: str) -> tl.Workflow:
    prep = tl.define_task("prep", run=lambda ctx: "prepared")
    gate = tl.define_gate("gate", kind=kind, prompt=f"{kind}?", actors=GATE_ACTORS[kind])
    after = tl.define_task("after", run=lambda ctx: {"gate": ctx.value("gate"), "prep": ctx.value("prep")},
                           after=[gate, prep])
    return tl.define_workflow(f"fuzz-gate-{kind}", version="1", tasks=[prep, gate, after])


GATES = {kind: _gated(kind) for kind in GATE_ACTORS}

# --- a plain run, to see that a worker still works ---------------------------------------------

ping = tl.define_task("ping", run=lambda ctx: "pong")
PING = tl.define_workflow("fuzz-ping", version="1", tasks=[ping])
