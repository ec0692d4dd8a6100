"""Every ``pip install`` the project shows a user works as written today (issue 25 item 8).

cloudckpt is not on the package index, so ``pip install 'cloudckpt[gcs]'`` finds nothing.
Every install line in the repository (README, docs, examples, Dockerfile, terraform, the
compose file, tools, and the messages and ``--help`` texts in the package) must be one of:

- an install **from the root of a clone**: ``pip install .``, ``pip install '.[gcs]'``,
  ``pip install -e '.[demo]'``, ``pip install -c constraints.txt 'torch==2.13.0' -e
  '.[test]'``; the extras exist in pyproject.toml and the files named exist;
- an install of packages that **are** on the index (``pip install azure-identity``, the
  packages of an extra named in a hint): one ``pip install --dry-run --no-deps`` resolves
  them all;
- a package from another index it names (``--index-url https://download.pytorch.org/...``):
  only torch, as the Dockerfile installs it.

Then the README's GCS line is resolved verbatim from the repository root with pip's dry run
(tests/test_install.py resolves every extra, and .ci/run installs each for real).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from cloudckpt._install import extra_requirements, install_hint

REPO = Path(__file__).resolve().parents[1]


def _extras() -> set[str]:
    import tomllib  # Python 3.11+, as the test environment is

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return set(pyproject["project"]["optional-dependencies"])


EXTRAS = _extras()
# pip options that take a value, as the docs use them.
VALUE_OPTIONS = {
    "-c",
    "--constraint",
    "-r",
    "--requirement",
    "--index-url",
    "-i",
    "--extra-index-url",
}
FILE_OPTIONS = {"-c", "--constraint", "-r", "--requirement"}
FLAGS = {
    "-e",
    "--editable",
    "-q",
    "--quiet",
    "--no-compile",
    "--disable-pip-version-check",
    "-U",
    "--upgrade",
}
# Where a command ends inside prose, code or markup: a code span or string closes, a
# comment or another command starts.
_END = re.compile(r"`|\s#|&&|;|\||\(|\)|\"|\\n|\s+(?:to|and|or|then|first|after)\s")
_LOCAL = re.compile(r"\.(?:\[([a-z0-9_,-]+)\])?")


@dataclass(frozen=True)
class InstallLine:
    where: str  # path:line
    command: str  # from "pip install" to where the command ends

    def args(self) -> list[str]:
        return shlex.split(self.command)[2:]


def _sources() -> list[Path]:
    """Every tracked text file but the tests (which quote broken commands on purpose)."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    # cloudckpt/_install.py builds the hints from templates; the hints themselves are
    # checked by test_hints_name_the_extras_packages_and_the_clone_form.
    skip = ("tests/", ".ci/node/", "cloudckpt/_install.py")
    return [
        REPO / p
        for p in listed
        if not p.startswith(skip) and (REPO / p).is_file() and (REPO / p).suffix not in {".png"}
    ]


def _command_at(text: str, start: int) -> str:
    """The command that starts at ``text[start:]`` ("pip install ..."): inside a code span
    (an odd number of backticks before it on its line) up to the span's end, across line
    breaks; otherwise up to the end of the line or where prose, a comment or another
    command begins."""
    line_start = text.rfind("\n", 0, start) + 1
    if text.count("``", line_start, start) % 2:  # reStructuredText: ``...``
        rest = text[start : text.index("``", start)]
        rest = re.sub(r"\s*\n\s*", " ", rest)
    elif text.count("`", line_start, start) % 2:
        rest = text[start : text.index("`", start)]
        rest = re.sub(r"\s*\n\s*", " ", rest)
    else:
        rest = text[start:].split("\n", 1)[0]
    end = _END.search(rest, len("pip install"))
    command = (rest[: end.start()] if end else rest).rstrip()
    # A sentence's full stop or comma, never a lone "." (the repository root).
    return re.sub(r"(?<=\S)[.,:]$", "", command)


def install_lines() -> list[InstallLine]:
    found = []
    for path in _sources():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for m in re.finditer(r"\bpip install\b", text):
            number = text.count("\n", 0, m.start()) + 1
            found.append(
                InstallLine(f"{path.relative_to(REPO)}:{number}", _command_at(text, m.start()))
            )
    return found


def _classify(line: InstallLine) -> tuple[list[str], list[str], list[str]]:
    """(local requirements, index requirements, other-index requirements) of one line.
    Fails the test on anything that cannot work."""
    args = line.args()
    local, index, other = [], [], []
    other_index = any(a in ("--index-url", "-i") for a in args)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in VALUE_OPTIONS:
            value = args[i + 1]
            if arg in FILE_OPTIONS:
                assert (REPO / value).is_file(), f"{line.where}: {value} does not exist"
            i += 2
            continue
        i += 1
        if arg in FLAGS:
            continue
        assert not arg.startswith("-"), f"{line.where}: unknown pip option {arg!r}"
        name = re.split(r"[\[<>=!~@ ]", arg, maxsplit=1)[0].lower()
        assert name != "cloudckpt", (
            f"{line.where}: `{line.command}` cannot work: cloudckpt is not on the package "
            "index. Write the install from a clone (pip install '.[extra]' from its root)"
        )
        if arg.startswith("."):
            m = _LOCAL.fullmatch(arg)
            assert m, f"{line.where}: {arg!r}: install from the repository root as . or .[extra]"
            unknown = set((m.group(1) or "").split(",")) - EXTRAS - {""}
            assert not unknown, f"{line.where}: no such extra {sorted(unknown)} in pyproject.toml"
            local.append(arg)
        elif other_index:
            other.append(arg)
        else:
            index.append(arg)
    assert local or index or other, f"{line.where}: `{line.command}` installs nothing"
    return local, index, other


LINES = install_lines()


def test_the_extraction_finds_the_install_lines_users_read():
    where = {line.where.split(":")[0] for line in LINES}
    for expected in (
        "README.md",
        "docs/install.md",
        "docs/integrations/huggingface.md",
        "examples/hf_trainer.py",
        "Dockerfile",
        "terraform/README.md",
    ):
        assert expected in where, f"no install line found in {expected}"
    assert len(LINES) > 20


@pytest.mark.parametrize("line", LINES, ids=[line.where for line in LINES])
def test_every_install_line_is_one_that_works_as_written(line):
    _, _, other = _classify(line)
    for requirement in other:  # another index: what the Dockerfile takes from PyTorch's
        assert requirement.startswith("torch=="), f"{line.where}: {requirement}"


def test_hints_name_the_extras_packages_and_the_clone_form():
    for extra in ("gcs", "azure", "demo", "torch", "hf", "lightning"):
        hint = install_hint(extra)
        packages = extra_requirements(extra)
        assert packages, extra
        assert f"pip install '.[{extra}]'" in hint
        command = re.search(r"pip install [^(]*", hint).group(0).strip()
        assert shlex.split(command)[2:] == packages, hint


def test_index_packages_resolve_and_the_readme_gcs_line_resolves_from_the_root(tmp_path):
    """One dry run for every package the lines and hints take from the index, and the
    README's `pip install '.[gcs]'` verbatim (plus --dry-run) in the repository root."""
    specs = sorted({r for line in LINES for r in _classify(line)[1]})
    for extra in ("gcs", "azure", "demo", "torch", "hf", "lightning"):
        specs += [r for r in extra_requirements(extra) if r not in specs]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
    index = subprocess.run(
        [*pip, "--no-deps", *specs], capture_output=True, text=True, env=env, timeout=600
    )
    assert index.returncode == 0, f"{specs}\n{index.stdout[-3000:]}{index.stderr[-3000:]}"

    (readme_gcs,) = [
        line for line in LINES if line.where.startswith("README.md") and "[gcs]" in line.command
    ]
    resolved = subprocess.run(
        [*pip[:3], *shlex.split(readme_gcs.command)[1:], *pip[4:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert resolved.returncode == 0, resolved.stdout[-3000:] + resolved.stderr[-3000:]
    assert re.search(r"Would install .*\bgcsfs-", resolved.stdout), resolved.stdout[-2000:]
    assert re.search(r"Would install .*\bcloudckpt-", resolved.stdout), resolved.stdout[-2000:]
