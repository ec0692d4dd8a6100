"""Validate a docker-compose.yml offline, as ``docker compose config -q`` does, with nothing
but Python packages from the index (PyYAML, jsonschema): no Docker engine, no
docker-compose binary.

1. Interpolation as Compose does it: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
   ``${VAR:?error}``, ``${VAR?error}``, ``${VAR:+alt}``, ``$VAR``, ``$$`` (a literal ``$``),
   with the variables given (none: every default applies); bad syntax is a problem.
2. The result against the Compose Specification's JSON schema, vendored in
   ``tests/data/compose-spec.json`` (the compose-spec project's, Apache-2.0, as
   check-jsonschema ships it; ``tests/data/LICENSE.compose-spec``).
3. What the schema cannot say and Compose refuses: ``depends_on`` naming a service that
   does not exist (or itself, or a cycle), a named volume or network a service uses but the
   file does not declare, a port outside 1-65535, a ``build`` context or Dockerfile missing.

``problems(path)`` returns what is wrong (empty: valid); ``python tests/compose_check.py
FILE`` prints them and exits 1 if there are any.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


class InterpolationError(ValueError):
    """A ``$`` expression Compose would refuse, or a required variable that is unset."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """``text`` with its variables replaced as Compose replaces them. Raises
    InterpolationError."""

    def one(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("invalid") is not None:
            raise InterpolationError(f"invalid interpolation format in {text!r}")
        name = m.group("braced") or m.group("named")
        op, arg = m.group("op"), m.group("arg") or ""
        value = env.get(name)
        unset_or_empty = not value
        missing = unset_or_empty if op and op.startswith(":") else value is None
        if op in (":-", "-"):
            return arg if missing else str(value)
        if op in (":?", "?"):
            if missing:
                raise InterpolationError(f"required variable {name} is missing: {arg}")
            return str(value)
        if op in (":+", "+"):
            return "" if missing else arg
        return value or ""

    return _VAR.sub(one, text)


def _interpolate_all(node: Any, env: Mapping[str, str], where: str) -> Any:
    if isinstance(node, str):
        try:
            return interpolate(node, env)
        except InterpolationError as exc:
            raise InterpolationError(f"{where}: {exc}") from None
    if isinstance(node, list):
        return [_interpolate_all(v, env, f"{where}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, dict):
        return {k: _interpolate_all(v, env, f"{where}.{k}") for k, v in node.items()}
    return node


def _schema_problems(doc: Any) -> Iterator[str]:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.path))):
        where = ".".join(map(str, error.absolute_path)) or "(top level)"
        yield f"{where}: {error.message}"


def _depends_on(service: Mapping[str, Any]) -> list[str]:
    deps = service.get("depends_on") or []
    return list(deps) if isinstance(deps, (list, dict)) else []


def _cycle(services: Mapping[str, Any]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in _depends_on(services.get(name) or {}):
            if dep not in services:
                continue
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[name] = 2
        return None

    for name in services:
        if name not in state and (found := visit(name)):
            return found
    return None


def _port_numbers(spec: Any) -> list[str]:
    """The port numbers (or ranges) of a short-syntax port: ``[IP:][HOST:]CONTAINER[/PROTO]``."""
    text = str(spec).rsplit("/", 1)[0]
    if text.startswith("["):  # [::1]:8080:80
        text = text.split("]", 1)[1].lstrip(":")
    parts = text.split(":")
    if len(parts) == 3:
        parts = parts[1:]  # the first is the address
    return [p for p in parts if p]


def _semantic_problems(doc: Mapping[str, Any], base: Path) -> Iterator[str]:
    services = doc.get("services") or {}
    volumes = set(doc.get("volumes") or {})
    networks = set(doc.get("networks") or {}) | {"default"}
    for name, service in services.items():
        service = service or {}
        for dep in _depends_on(service):
            if dep == name:
                yield f"services.{name}.depends_on: a service cannot depend on itself"
            elif dep not in services:
                yield f"services.{name}.depends_on: {dep!r} is not a service in this file"
        for i, volume in enumerate(service.get("volumes") or []):
            if isinstance(volume, dict):  # long syntax: a named volume is type volume
                source = volume.get("source") if volume.get("type") == "volume" else None
            else:  # SOURCE:TARGET[:MODE]; a lone TARGET is an anonymous volume
                source = volume.split(":")[0] if ":" in volume else None
            if source and not source.startswith(("/", ".", "~")) and source not in volumes:
                yield (
                    f"services.{name}.volumes[{i}]: named volume {source!r} is not declared "
                    "under the top-level volumes"
                )
        used = service.get("networks") or []
        for net in used:
            if net not in networks:
                yield f"services.{name}.networks: {net!r} is not declared under networks"
        for i, port in enumerate(service.get("ports") or []):
            if isinstance(port, dict):
                numbers = [str(port.get("target", "")), str(port.get("published", ""))]
            else:
                numbers = _port_numbers(port)
            for number in filter(None, numbers):
                bounds = number.split("-")
                if not all(b.isdigit() and 1 <= int(b) <= 65535 for b in bounds):
                    yield f"services.{name}.ports[{i}]: {port!r} is not a valid port"
        build = service.get("build")
        if build is not None:
            context = base / (build if isinstance(build, str) else build.get("context", "."))
            if not context.is_dir():
                yield f"services.{name}.build: the context {context} is not a directory"
            elif isinstance(build, dict) and "dockerfile_inline" not in build:
                dockerfile = context / build.get("dockerfile", "Dockerfile")
                if not dockerfile.is_file():
                    yield f"services.{name}.build: {dockerfile} does not exist"
    cycle = _cycle(services)
    if cycle:
        yield f"services: depends_on has a cycle: {' -> '.join(cycle)}"


def problems(path: Path, env: Mapping[str, str] | None = None) -> list[str]:
    """What ``docker compose -f PATH config -q`` would refuse in the file at ``path``, with
    the variables ``env`` set (None: none). Empty: the file is valid."""
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        return [f"not YAML: {exc}"]
    if not isinstance(raw, dict):
        return ["the top level is not a mapping"]
    try:
        doc = _interpolate_all(raw, env or {}, "")
    except InterpolationError as exc:
        return [str(exc).lstrip(".")]
    found = list(_schema_problems(doc))
    return found + list(_semantic_problems(doc, path.parent))


if __name__ == "__main__":  # pragma: no cover - a convenience for people
    found = problems(Path(sys.argv[1] if len(sys.argv) > 1 else "docker-compose.yml"))
    for line in found:
        print(line)
    sys.exit(1 if found else 0)
