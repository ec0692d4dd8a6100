"""The code map of docs/design.md §10 holds: every module of the package sits in a layer,
imports only from its own layer or below, and no import cycle exists. Imports under
``if TYPE_CHECKING:`` are annotations only and do not count; imports inside functions do."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cloudckpt"

# docs/design.md §10, bottom up. A name covers the module and everything below it.
LAYERS: list[tuple[str, list[str]]] = [
    ("ground", ["errors", "_version", "_install", "_crc32c", "failpoints", "retry", "digest"]),
    ("records and stores", ["protocol", "retention", "stores"]),
    ("protocol", ["committer", "attempts", "reader", "transfer", "chunks", "staging",
                  "restore", "verify", "gc", "repair", "admin", "copying",
                  "fetch", "localcopy"]),
    ("library", ["manager", "distributed", "watch", "preemption", "catalog"]),
    ("integrations", ["integrations"]),
    ("top and test tools", ["", "cli", "demo", "_demo_train", "testing"]),
]  # fmt: skip


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
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
    annotations_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
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


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: _imports(p, m, set(paths)) for m, p in paths.items()}


def test_every_import_goes_down_the_layers():
    upward = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in sorted(_graph().items())
        for d in sorted(deps)
        if _layer(d) > _layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = _graph()
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
    assert len(graph) > 60 and graph["cloudckpt.attempts"] >= {"cloudckpt.committer"}
    # The simulation's writer imports the world under TYPE_CHECKING only (the world
    # imports the writer): counted, that would be a cycle.
    writer = graph["cloudckpt.testing.simulation.actors.writer"]
    assert "cloudckpt.testing.simulation.plumbing" in writer
    assert "cloudckpt.testing.simulation.world" not in writer
