"""The trainer checkpoint layouts ``watch`` recognises on disk: how each is found, which
step it holds, and when it is complete (``cloudckpt.watch`` runs the loop around them).

A checkpoint is taken as soon as the framework's own last write shows it complete (read
from the installed transformers 5, Lightning 2.6 and accelerate 1.x sources); waiting for
files to stay unchanged is only a fallback where no such write exists:

``checkpoint-N/`` (Hugging Face ``Trainer``; step N)
    ``trainer_state.json`` exists and parses. ``Trainer._save_checkpoint`` writes the model,
    ``training_args.bin``, optimizer, scheduler, scaler and RNG state, then
    ``trainer_state.json``, and only then rotates *older* checkpoints
    (``save_total_limit``). With one process (``rng_state.pth``) that is final. With
    several, every rank writes its own ``rng_state_K.pth`` with no barrier after it, so the
    files must also be unchanged for ``settle`` seconds (and ranks 0..K all present).
``*.ckpt`` files (Lightning ``ModelCheckpoint``; the step comes from ``step=S``)
    A complete zip archive. Lightning's ``_atomic_save`` serialises into memory and writes
    through an fsspec transaction: a temporary file renamed into place on one filesystem,
    copied into place across filesystems; ``torch.save``'s zip central directory comes
    last, so a partial copy is never readable. A ``.ckpt`` that is not a zip archive
    (legacy format) needs ``settle``. Names without ``step=`` (``last.ckpt``) are skipped.
``*.ckpt/`` directories (Lightning FSDP / model-parallel sharded checkpoints)
    ``meta.pt`` is a complete zip: rank 0 writes it after ``torch.distributed.checkpoint``
    finished every shard and ``.metadata`` (which alone is not enough).
``checkpoint_N/`` in the directory or in its ``checkpoints/`` (``accelerate`` with
``automatic_checkpoint_naming``; step N)
    accelerate writes no completion marker. Its ``save_state`` writes weights, optimizer,
    scheduler, sampler and scaler, then every process its own ``random_states_K.pkl``,
    then the main process any ``custom_checkpoint_K.pkl``. Complete when
    ``checkpoint_{N+1}`` exists (accelerate creates it only after a barrier every process
    reaches once done with N), else when ``random_states_0.pkl`` is a complete zip, ranks
    0..K are all present and the files are unchanged for ``settle``. N is accelerate's save
    counter (``ProjectConfiguration.iteration``), not the optimizer step: accelerate
    records no training step (the ``step`` in ``random_states_K.pkl`` is its gradient
    accumulation counter, reset every epoch).
``global_stepN/`` beside a ``latest`` file (DeepSpeed ``engine.save_checkpoint``; step N)
    ``latest`` names it (or a later ``global_stepM``) and every ``.pt`` file in it is a
    complete zip. DeepSpeed's rank 0 writes ``latest`` after its own files but with no
    barrier after the other ranks' ZeRO shards (``[bf16_]zero_pp_rank_R_...``), so with
    shards present ranks 0..R must all be there and unchanged for ``settle``. The
    checkpoint holds ``global_stepN/`` and a ``latest`` naming it (DeepSpeed's layout, which
    ``cloudckpt.integrations.deepspeed.load_checkpoint`` reads).
any other directory with a marker file (default ``.complete``)
    The writer's own "done" signal. The step is the marker's content (an integer, or JSON
    with ``"step"``) or else the number the directory name ends with.
any directory whose name ends with a number, quiet for ``quiet_period`` (opt-in only)
    ``accept_quiet_dirs=True``. Beware: a writer killed half-way leaves a directory that is
    quiet forever, and this rule would commit it. Prefer markers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zipfile
from pathlib import Path

HF_DIR = re.compile(r"^checkpoint-(\d+)$")
HF_STATE = "trainer_state.json"
HF_SINGLE_RNG = "rng_state.pth"  # world_size <= 1
HF_RANK_RNG = re.compile(r"^rng_state_(\d+)\.pth$")  # one per process otherwise
ACCELERATE_DIR = re.compile(r"^checkpoint_(\d+)$")
ACCELERATE_PARENT = "checkpoints"  # ProjectConfiguration(automatic_checkpoint_naming=True)
ACCELERATE_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
LIGHTNING_STEP = re.compile(r"(?:^|[-_])step=(\d+)")
LIGHTNING_META = "meta.pt"
DS_DIR = re.compile(r"^global_step(\d+)$")
DS_LATEST = "latest"  # DeepSpeed's rank 0 writes the tag here after saving it
DS_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")
DS_SIDE_FILES = (DS_LATEST, "zero_to_fp32.py", "zero_to_torch.py")  # beside global_stepN/
TRAILING_NUMBER = re.compile(r"(\d+)$")
TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock")
MAX_DEPTH = 4  # how deep *.ckpt files are looked for (lightning_logs/version_0/checkpoints)

Signature = tuple[tuple[str, int, int], ...]  # (relative path, size, mtime_ns) per file


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Something in the watched directory that is, or will become, a checkpoint."""

    path: Path
    source: str  # path relative to the watched directory, '/'-separated
    kind: str  # "hf", "lightning", "lightning-dir", "accelerate", "deepspeed", "marker", "quiet"
    step: int | None

    @property
    def is_file(self) -> bool:
        return self.kind == "lightning"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a candidate is complete, and the rule that says so (shown in the output)."""

    complete: bool
    rule: str  # why it is complete, or what it still lacks
    settle: float = 0.0  # seconds its files must still stay unchanged; 0: take it now


def _zip_state(path: Path) -> str:
    """``"complete"``, ``"partial"`` or ``"not-zip"``. ``torch.save`` writes a zip archive
    whose central directory comes last, so a file cut short (or still being copied) has
    none and cannot be opened."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            return "not-zip" if len(magic) == 4 else "partial"
        with zipfile.ZipFile(path) as z:
            z.namelist()
        return "complete"
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return "partial"


def _ranks(names: set[str], pattern: re.Pattern[str]) -> tuple[set[int], list[int]]:
    """The rank numbers of files named by ``pattern`` and the ranks below the highest that
    are missing (a rank still writing its file)."""
    ranks = {int(m.group(1)) for n in names if (m := pattern.match(n))}
    return ranks, sorted(set(range(max(ranks) + 1)) - ranks) if ranks else []


def _marker_step(path: Path) -> int | None:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    if text.isdigit():
        return int(text)
    try:
        body = json.loads(text) if text else None
    except ValueError:
        return None
    step = body.get("step") if isinstance(body, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _latest_names(c: Candidate) -> bool:
    """Whether DeepSpeed's ``latest`` beside ``c`` names it or a later ``global_stepM``
    (DeepSpeed saves in order, so a later tag means this one was finished)."""
    try:
        named = (c.path.parent / DS_LATEST).read_text(errors="replace").strip()
    except OSError:
        return False
    later = DS_DIR.match(named)
    return named == c.path.name or bool(later and int(later.group(1)) > (c.step or 0))


def _is_temp(name: str) -> bool:
    """Names writers use for files and directories still being written."""
    return name.startswith(".") or name.startswith("tmp-") or name.endswith(TEMP_SUFFIXES)


def find_candidates(
    directory: Path, markers: tuple[str, ...], accept_quiet_dirs: bool
) -> tuple[list[Candidate], dict[str, list[str]]]:
    """Every checkpoint-like entry under ``directory`` (complete or not), and per directory
    (relative, '/'-separated) the names of the files that belong to no checkpoint."""
    found: list[Candidate] = []
    loose_by_dir: dict[str, list[str]] = {}
    _scan_dir(directory, directory, 0, found, loose_by_dir, markers, accept_quiet_dirs)
    return found, loose_by_dir


def _scan_dir(
    directory: Path,
    root: Path,
    depth: int,
    found: list[Candidate],
    loose_by_dir: dict[str, list[str]],
    markers: tuple[str, ...],
    accept_quiet_dirs: bool,
) -> None:
    """``find_candidates`` below ``root`` (``depth`` levels under ``directory``)."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    loose = []
    for entry in entries:
        name = entry.name
        if _is_temp(name):
            continue
        path = Path(entry.path)
        source = path.relative_to(directory).as_posix()
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = entry.is_file(follow_symlinks=False)
        except OSError:
            continue
        if is_file and name.endswith(".ckpt"):
            m = LIGHTNING_STEP.search(name[: -len(".ckpt")])
            found.append(Candidate(path, source, "lightning", int(m.group(1)) if m else None))
        elif not is_dir:
            loose.append(name)  # a plain file (or a link such as last.ckpt)
        elif candidate := _classify_dir(path, source, depth, markers, accept_quiet_dirs):
            found.append(candidate)
        elif depth < MAX_DEPTH:
            _scan_dir(directory, path, depth + 1, found, loose_by_dir, markers, accept_quiet_dirs)
    if any(c.kind == "deepspeed" and c.path.parent == root for c in found):
        loose = [n for n in loose if n not in DS_SIDE_FILES]  # read, not uploaded as is
    if loose:
        loose_by_dir[root.relative_to(directory).as_posix()] = loose


def _classify_dir(
    path: Path, source: str, depth: int, markers: tuple[str, ...], accept_quiet_dirs: bool
) -> Candidate | None:
    """The candidate the directory ``path`` is by its layout, or None (look inside it)."""
    name = path.name
    if depth == 0 and (m := HF_DIR.match(name)):
        return Candidate(path, source, "hf", int(m.group(1)))
    if (m := ACCELERATE_DIR.match(name)) and (
        depth == 0 or (depth == 1 and path.parent.name == ACCELERATE_PARENT)
    ):
        return Candidate(path, source, "accelerate", int(m.group(1)))
    if m := DS_DIR.match(name):
        return Candidate(path, source, "deepspeed", int(m.group(1)))
    if name.endswith(".ckpt"):
        m = LIGHTNING_STEP.search(name[: -len(".ckpt")])
        return Candidate(path, source, "lightning-dir", int(m.group(1)) if m else None)
    if marker := next((mk for mk in markers if (path / mk).is_file()), None):
        step = _marker_step(path / marker)
        if step is None and (m := TRAILING_NUMBER.search(name)):
            step = int(m.group(1))
        return Candidate(path, source, "marker", step)
    if accept_quiet_dirs and depth == 0 and (m := TRAILING_NUMBER.search(name)):
        return Candidate(path, source, "quiet", int(m.group(1)))
    return None


def judge_candidate(
    c: Candidate, sig: Signature, *, settle: float, quiet_period: float, markers: tuple[str, ...]
) -> Verdict:
    """The completeness rule of ``c``'s layout (module doc), on the files of ``sig``; the
    caller applies the verdict's ``settle``."""
    names = {rel for rel, _, _ in sig}
    if c.kind == "hf":
        return _judge_hf(c, names, settle)
    if c.kind == "lightning":
        state = _zip_state(c.path) if sig[0][1] > 0 else "partial"
        if state == "complete":
            return Verdict(True, "a complete torch.save archive (Lightning writes by rename)")
        if state == "not-zip":
            return Verdict(True, f"not a zip archive: unchanged for {settle:g}s", settle)
        return Verdict(False, "its zip archive is not complete yet")
    if c.kind == "lightning-dir":
        if LIGHTNING_META in names and _zip_state(c.path / LIGHTNING_META) == "complete":
            return Verdict(True, "meta.pt written (Lightning writes it after every shard)")
        return Verdict(False, "no complete meta.pt yet (Lightning writes it last)")
    if c.kind == "accelerate":
        return _judge_accelerate(c, names, settle)
    if c.kind == "deepspeed":
        return _judge_deepspeed(c, names, settle)
    if c.kind == "marker":
        marker = next((mk for mk in markers if mk in names), None)
        if marker is None:
            return Verdict(False, "its marker file is gone")
        return Verdict(True, f"marker file {marker}")
    return Verdict(
        bool(sig),
        f"unchanged for {quiet_period:g}s (--accept-quiet-dirs)",
        quiet_period,
    )


def _judge_hf(c: Candidate, names: set[str], settle: float) -> Verdict:
    if HF_STATE not in names:
        return Verdict(False, "no trainer_state.json yet (Trainer writes it last)")
    try:
        json.loads((c.path / HF_STATE).read_bytes())
    except (OSError, ValueError):
        return Verdict(False, "trainer_state.json is still being written")
    if HF_SINGLE_RNG in names:
        return Verdict(True, "trainer_state.json written (the Trainer's last file)")
    ranks, missing = _ranks(names, HF_RANK_RNG)
    if missing:
        return Verdict(False, f"rng_state_{missing[0]}.pth of another rank not written yet")
    who = f"{len(ranks)} ranks' rng_state files" if ranks else "no rng_state file"
    return Verdict(
        True,
        f"trainer_state.json written, {who}, unchanged for {settle:g}s",
        settle,
    )


def _judge_accelerate(c: Candidate, names: set[str], settle: float) -> Verdict:
    after = f"checkpoint_{(c.step or 0) + 1}"  # the kind always has a step (its name)
    if (c.path.parent / after).is_dir():
        return Verdict(True, f"{after} begun (accelerate's next save starts after all finished)")
    ranks, missing = _ranks(names, ACCELERATE_RNG)
    if 0 not in ranks:
        return Verdict(False, "no random_states_0.pkl yet (accelerate writes it last)")
    if missing:
        return Verdict(False, f"random_states_{missing[0]}.pkl of another process not written yet")
    if _zip_state(c.path / "random_states_0.pkl") != "complete":
        return Verdict(False, "random_states_0.pkl is still being written")
    return Verdict(True, f"random_states_*.pkl written, unchanged for {settle:g}s", settle)


def _judge_deepspeed(c: Candidate, names: set[str], settle: float) -> Verdict:
    if not _latest_names(c):
        return Verdict(False, "`latest` does not name it yet (DeepSpeed writes it last)")
    for rel in sorted(names):
        if rel.endswith(".pt") and _zip_state(c.path / rel) != "complete":
            return Verdict(False, f"{rel} is still being written")
    ranks, missing = _ranks({Path(n).name for n in names}, DS_SHARD)
    if missing:
        return Verdict(False, f"the ZeRO shard of rank {missing[0]} is not written yet")
    if not ranks:
        return Verdict(True, "`latest` names it (DeepSpeed writes it after its files)")
    return Verdict(
        True,
        f"`latest` names it, {len(ranks)} ranks' ZeRO shards, unchanged for {settle:g}s",
        settle,
    )
