"""What a seed reports: ``SimResult``, the replay command, and the violation it raises."""

from __future__ import annotations

import collections
import dataclasses

DEFAULT_STEPS = 250


def replay_command(seed: int, steps: int = DEFAULT_STEPS) -> str:
    """The one command that replays ``seed``."""
    extra = "" if steps == DEFAULT_STEPS else f" --steps {steps}"
    return f"python -m cloudckpt.testing.simulation --seed {seed}{extra}"


class InvariantViolation(AssertionError):
    """The simulated world broke an invariant of docs/design.md §9."""


@dataclasses.dataclass
class SimResult:
    """What one seed did. ``violations`` is empty when every invariant held."""

    seed: int
    steps: int
    ticks: int = 0
    counters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    faults: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    violations: list[str] = dataclasses.field(default_factory=list)
    trace_digest: str = ""
    trace_tail: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        """A human-readable failure report with the replay command."""
        lines = [
            f"simulation seed {self.seed} ({self.ticks} ticks): "
            + ("OK" if self.ok else f"{len(self.violations)} invariant violation(s)"),
            *(f"  - {v}" for v in self.violations[:10]),
        ]
        if not self.ok:
            lines += ["  last store calls:", *(f"    {t}" for t in self.trace_tail[-40:])]
            lines.append(f"  replay: {replay_command(self.seed, self.steps)}")
        return "\n".join(lines)
