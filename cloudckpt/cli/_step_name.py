"""``push`` without ``--step``: the step read from the checkpoint directory's name, as the
trainers name it (Hugging Face ``checkpoint-500``, DeepSpeed ``global_step500``, Lightning
``epoch=3-step=500``, and ``step_500``/``step-500``/``step500``)."""

from __future__ import annotations

import re

from cloudckpt.errors import ConfigurationError

# A step marker starts the name or follows a separator, so "laststep5" and "v2checkpoint-1"
# name no step; "global_step" is matched whole before "step" could match inside it.
_STEP = re.compile(
    r"(?<![A-Za-z0-9])(?:checkpoint-|global_step|step[_=-]?)(\d+)(?![0-9])", re.IGNORECASE
)

_HINT = "Pass the step with --step N (e.g. push ./ckpt URL --step 500)"


def step_from_name(name: str) -> int:
    """The step that the directory name ``name`` names.

    Raises: ConfigurationError when it names none (no ``checkpoint-N``, ``global_stepN``,
    ``step_N``), or names more than one different step (ambiguous).
    """
    steps = sorted({int(m.group(1)) for m in _STEP.finditer(name)})
    if not steps:
        raise ConfigurationError(
            f"cannot tell the step from the directory name {name!r}: it has no "
            "checkpoint-N, global_stepN or step_N in it",
            hint=_HINT,
        )
    if len(steps) > 1:
        raise ConfigurationError(
            f"the directory name {name!r} names more than one step "
            f"({', '.join(map(str, steps))}): which one is this checkpoint's is ambiguous",
            hint=_HINT,
        )
    return steps[0]
