"""The code map of docs/design.md §10 holds: every module of the package sits in a layer,
imports only from its own layer or below, and no import cycle exists. Every import
counts: inside functions, and under ``if TYPE_CHECKING:`` too (an annotation that names a
module above is still a dependency on it; name what is needed by a ``Protocol`` below)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cloudckpt"

DESIGN = PACKAGE.parent / "docs" / "design.md"


def _rows() -> list[tuple[str, list[str]]]:
    """docs/design.md §10's table, bottom up: (layer, modules) per row. A name covers the
    module and everything below it; ``cloudckpt`` is the package's own ``__init__``."""
    text = DESIGN.read_text()
    section = text[text.index("## 10. Code map") : text.index("## 11.")]
    rows: list[tuple[str, list[str]]] = []
    layer = ""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or cells[1] in ("Module", "---"):
            continue
        layer = cells[0] or layer
        names = re.findall(r"`([^`]+)`", cells[1])
        rows.append((layer, ["" if n == "cloudckpt" else n.rstrip("/") for n in names]))
    return rows


LAYERS = _rows()


def _module(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    rest = module.removeprefix("cloudckpt").removeprefix(".")
    for n, (_, names) in enumerate(LAYERS):
        for name in names:
            if rest == name or (name and rest.startswith(name + ".")):
                return n
    raise AssertionError(f"{module} is in no layer of docs/design.md §10 (tests/test_layers.py)")


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            submodules = {f"{base}.{a.name}" for a in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)  # a name from the package's own __init__
    return {m for m in found if m in known and m != module}


def _graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {_module(p, package): p for p in package.rglob("*.py")}
    return {m: _imports(p, m, set(paths)) for m, p in paths.items()}


def test_every_import_goes_down_the_layers():
    upward = [
        f"{m} (row {_layer(m)}, {LAYERS[_layer(m)][0]}) imports {d} (row {_layer(d)}: "
        f"{LAYERS[_layer(d)][0]}, {LAYERS[_layer(d)][1]})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if _layer(d) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("package", ["cloudckpt", "benchmarks"])
def test_no_import_cycle(package):
    graph = _graph(PACKAGE.parent / package)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = [*path[path.index(d) :], d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checks_see_what_they_claim():
    graph = _graph()
    # The table was read: rows ordered as written, each module on exactly one row.
    assert len(LAYERS) >= 15 and LAYERS[0][1] == ["_install", "_version"]
    assert LAYERS[-1][1] == ["cli"]
    names = [n for _, row in LAYERS for n in row]
    assert len(names) == len(set(names)), names
    assert _layer("cloudckpt.attempts") > _layer("cloudckpt.reader") > _layer("cloudckpt.committer")
    assert len(graph) > 60 and graph["cloudckpt.attempts"] >= {"cloudckpt.committer"}
    # Imports under TYPE_CHECKING count: the simulation's writer imports the actor only
    # there, and it is seen. The world (which imports the writer) it names by a Protocol
    # (actor.World), so it does not import it: that would be a cycle.
    writer = graph["cloudckpt.testing.simulation.actors.writer"]
    sim = "cloudckpt.testing.simulation"
    assert {f"{sim}.plumbing", f"{sim}.actor"} <= writer
    assert f"{sim}.world" not in writer
    assert f"{sim}.world" in graph[f"{sim}.runner"] and f"{sim}.actor" in graph[f"{sim}.world"]
    # The benchmarks' groups import the shared harness, and the runner imports them
    # (inside functions): seen, and not back.
    bench = _graph(PACKAGE.parent / "benchmarks")
    assert "benchmarks.harness" in bench["benchmarks.resume"]
    assert "benchmarks.resume" in bench["benchmarks.run"]
    assert "benchmarks.run" not in bench["benchmarks.resume"]
