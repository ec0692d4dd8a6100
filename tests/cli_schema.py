"""The ``--json`` schemas written in docs/cli.md, parsed, and a check of real output against
them (used by tests/test_cli_json.py, test_watch.py and test_demo.py).

A schema block is an HTML comment naming it, then a Markdown list, one field per item::

    <!-- json: ls -->
    - `url` string: the run
    - `writer` object|null: the run's writer; null for an empty run
      - `epoch` integer: its fencing epoch
    - `checkpoints` array[object]: newest first
      - `step` integer: the training step
    - `metadata` object*: what the writer recorded (any keys)
    - `version`? string: only in compare-and-swap writes

Types: ``string``, ``integer``, ``number``, ``boolean``, ``null``, ``object`` (its fields
are the nested items), ``object*`` (any keys, not checked), ``array[T]`` (T any of these),
``any``; ``|`` between alternatives. A ``?`` after the name: the field may be absent. Two
more spaces of indentation per level. ``watch`` has one block per event kind: ``<!-- json:
watch event=queued -->``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"

_MARKER = re.compile(r"^<!-- json: ([a-z][a-z0-9_-]*(?: event=[a-z_]+)?) -->$")
_ITEM = re.compile(
    r"^(?P<indent> *)- `(?P<name>[A-Za-z_][A-Za-z0-9_]*)`(?P<opt>\??) (?P<type>\S+): \S"
)
_TYPE = re.compile(r"(string|integer|number|boolean|null|object\*?|any|array\[(?:\w+\*?)\])")


@dataclass
class Field:
    name: str
    types: list[str]  # alternatives: "string", "array[object]", ...
    optional: bool
    fields: dict[str, Field] = field(default_factory=dict)  # for object / array[object]


def parse(text: str | None = None) -> dict[str, dict[str, Field]]:
    """Every schema block in docs/cli.md: name -> top-level fields.

    Raises AssertionError (with the line) for a malformed block."""
    lines = (DOCS.read_text() if text is None else text).splitlines()
    schemas: dict[str, dict[str, Field]] = {}
    i = 0
    while i < len(lines):
        m = _MARKER.match(lines[i].strip())
        i += 1
        if not m:
            continue
        name = m.group(1)
        assert name not in schemas, f"docs/cli.md: two schema blocks for {name!r}"
        top: dict[str, Field] = {}
        stack: list[tuple[int, dict[str, Field]]] = [(-1, top)]
        last: tuple[int, Field] | None = None
        while i < len(lines) and lines[i].strip():
            line = lines[i]
            item = _ITEM.match(line)
            if item is None:  # a continuation of the item above
                assert last is not None and not line.lstrip().startswith("- "), (
                    f"docs/cli.md:{i + 1}: not a schema item: {line!r}"
                )
                i += 1
                continue
            indent = len(item.group("indent"))
            if last is not None and indent > last[0]:
                assert indent == last[0] + 2, f"docs/cli.md:{i + 1}: indent by two spaces"
                assert any(t in ("object", "array[object]") for t in last[1].types), (
                    f"docs/cli.md:{i + 1}: fields under {last[1].name}, which is no object"
                )
                stack.append((last[0], last[1].fields))
            while stack[-1][0] >= indent:
                stack.pop()
            types = item.group("type").split("|")
            for t in types:
                assert _TYPE.fullmatch(t), f"docs/cli.md:{i + 1}: unknown type {t!r}"
            f = Field(item.group("name"), types, item.group("opt") == "?")
            fields = stack[-1][1]
            assert f.name not in fields, f"docs/cli.md:{i + 1}: {f.name} twice"
            fields[f.name] = f
            last = (indent, f)
            i += 1
        assert top, f"docs/cli.md: the schema block {name!r} lists no fields"
        schemas[name] = top
    return schemas


def _is(value: Any, t: str) -> bool:
    if t == "any":
        return True
    if t == "string":
        return isinstance(value, str)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    if t in ("object", "object*"):
        return isinstance(value, dict)
    return isinstance(value, list)  # array[...]


def check(doc: Any, fields: dict[str, Field], where: str = "$") -> list[str]:
    """Every way ``doc`` differs from ``fields``: a field the docs do not list, a listed
    field that is missing (unless optional), a value of another type. [] if it matches."""
    if not isinstance(doc, dict):
        return [f"{where}: expected an object, got {type(doc).__name__}"]
    problems = [f"{where}.{k}: not documented" for k in sorted(set(doc) - set(fields))]
    for name, f in fields.items():
        if name not in doc:
            if not f.optional:
                problems.append(f"{where}.{name}: documented but missing")
            continue
        problems += _check_value(doc[name], f, f"{where}.{name}")
    return problems


def _check_value(value: Any, f: Field, where: str) -> list[str]:
    matching = [t for t in f.types if _is(value, t)]
    if not matching:
        return [f"{where}: {value!r:.80} is not {'|'.join(f.types)}"]
    t = matching[0]
    if t == "object":
        return check(value, f.fields, where)
    if t.startswith("array["):
        inner = t[len("array[") : -1]
        item = Field(f.name, [inner], False, f.fields)
        return [p for n, v in enumerate(value) for p in _check_value(v, item, f"{where}[{n}]")]
    return []


def assert_matches(doc: Any, name: str, schemas: dict[str, dict[str, Field]] | None = None) -> None:
    """Assert ``doc`` matches docs/cli.md's schema block ``name`` (for watch: the block of
    its event, ``watch event=<kind>``)."""
    schemas = parse() if schemas is None else schemas
    if name == "watch":
        name = f"watch event={doc.get('event')}"
    assert name in schemas, f"docs/cli.md has no schema block <!-- json: {name} -->"
    problems = check(doc, schemas[name])
    assert not problems, f"--json output of {name} differs from docs/cli.md:\n" + "\n".join(
        problems
    )
