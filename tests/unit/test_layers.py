"""The layers of docs/architecture.md, checked against the imports: every import of a taskloop
module goes to its own layer or one below (TYPE_CHECKING imports included), never to a package
its layer is barred from, and no module is over the size that asks for a split."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "taskloop"
# bottom to top: a module may import its own layer and the layers before it (docs/architecture.md)
LAYERS = [
    ("base",),
    ("celery_fixes",),
    ("connections",),
    ("define",),
    ("core",),
    ("store",),
    ("ops",),
    ("runtime",),
    ("worker",),
    ("cli", "ui", "examples"),
    ("__init__", "__main__", "celery"),
]
# packages a layer may not import though they are below it (docs/architecture.md): declarations
# do no I/O, so define/ reaches no client of connections/ (a context brings the model: runtime/judge.py)
BARRED = {"define": ("connections",)}
MAX_LINES = 500


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def layer_of(module: str) -> int:
    part = package_of(module)
    for n, names in enumerate(LAYERS):
        if part in names:
            return n
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 2 else parts), path))
    return found


def imports_of(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("taskloop"):
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if node.module in ("taskloop",)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("taskloop")]
    return found


@pytest.mark.parametrize(("module", "path"), modules(), ids=[m for m, _ in modules()])
def test_no_import_goes_up_a_layer(module: str, path: Path) -> None:
    mine = layer_of(module)
    upward = [target for target in imports_of(path) if target != "taskloop" and layer_of(target) > mine]
    assert not upward, f"{module} (layer {LAYERS[mine]}) imports from above: {upward}"


@pytest.mark.parametrize(("module", "path"), modules(), ids=[m for m, _ in modules()])
def test_no_import_goes_to_a_barred_package(module: str, path: Path) -> None:
    barred = BARRED.get(package_of(module), ())
    found = [target for target in imports_of(path) if target != "taskloop" and package_of(target) in barred]
    assert not found, f"{module} ({package_of(module)}/) imports from {barred}, which it may not: {found}"


def test_no_module_is_over_the_size_that_asks_for_a_split() -> None:
    sizes = {module: len(path.read_text().splitlines()) for module, path in modules()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_no_modules_import_each_other_in_a_circle() -> None:
    """docs/architecture.md: no import circles, TYPE_CHECKING imports included (``from pkg import
    module`` counts as an import of that module)."""
    known = {module for module, _ in modules()}
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("taskloop"):
                named = {f"{node.module}.{a.name}" for a in node.names} & known
                targets |= named or {node.module}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("taskloop")}
        graph[module] = (targets & known) - {module}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"an import circle: {' -> '.join(exc.args[1])}")


def test_docs_architecture_names_every_module() -> None:
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = set()
    for cell in text.split("`"):
        if cell.endswith((".py", ".lua")) or cell.endswith("/"):
            named.add(cell)
    missing = []
    for _module, path in modules():
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            continue  # a package is named by its modules (and its folder)
        if relative not in named and f"taskloop/{relative}" not in named:
            missing.append(relative)
    assert missing == [], f"docs/architecture.md does not name {missing}"
