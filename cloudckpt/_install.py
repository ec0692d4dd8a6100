"""What to type to install an extra, in words that work as written today.

cloudckpt is not on the package index: installing ``cloudckpt[gcs]`` by name finds nothing
(and would find someone else's package if the name were ever taken). So a hint names the
packages the extra adds, as the installed distribution declares them (``pip install
'gcsfs>=2024.6.0'`` works from anywhere, into the environment cloudckpt is installed in),
and the clone form (``pip install '.[gcs]'`` from the repository's root).
"""

from __future__ import annotations

import importlib.metadata
import re

_DIST = "cloudckpt"
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


def extra_requirements(extra: str) -> list[str]:
    """The requirements ``cloudckpt[extra]`` adds, as the installed distribution declares
    them (nested ``cloudckpt[...]`` extras expanded); [] when cloudckpt's metadata is not
    installed (running from a source tree) or the extra adds nothing."""
    try:
        declared = importlib.metadata.requires(_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    out: list[str] = []
    for line in declared:
        requirement, _, marker = line.partition(";")
        found = _EXTRA_MARKER.search(marker)
        if found is None or found.group(1) != extra:
            continue
        requirement = requirement.strip()
        nested = re.fullmatch(rf"{_DIST}\s*\[([^\]]+)\]", requirement)
        if nested:
            for name in nested.group(1).split(","):
                out += [r for r in extra_requirements(name.strip()) if r not in out]
        elif requirement not in out:
            out.append(requirement)
    return out


def install_hint(extra: str) -> str:
    """``Install it with: pip install 'gcsfs>=2024.6.0' (...)``: a command that works as
    written, then the form for a clone of the repository."""
    clone = f"from the root of a clone of cloudckpt, pip install '.[{extra}]'"
    packages = extra_requirements(extra)
    if not packages:
        return f"Install it from the root of a clone of cloudckpt: pip install '.[{extra}]'"
    command = "pip install " + " ".join(f"'{p}'" for p in packages)
    return f"Install it with: {command} (cloudckpt's [{extra}] extra; or, {clone})"
