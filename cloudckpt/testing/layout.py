"""Where a checkpoint's bytes are stored, for tests that damage them on purpose."""

from __future__ import annotations

from cloudckpt import attempt_layout
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.reader import fetch_manifest
from cloudckpt.stores import Store


def data_key(store: Store, record: CheckpointRecord, path: str, byte: int = 0) -> str:
    """The key of the object holding byte ``byte`` of file ``path`` of a checkpoint: the
    file itself (plain layout) or the chunk holding that byte (chunked layout)."""
    entry = next(f for f in fetch_manifest(store, record).files if f.path == path)
    if entry.chunks is None:
        return record.ckpt + attempt_layout.FILES_DIR + path
    offset = 0
    for chunk in entry.chunks:
        if offset <= byte < offset + chunk.size:
            return chunk.key
        offset += chunk.size
    raise ValueError(f"{path} has no byte {byte}")


def data_bit(store: Store, record: CheckpointRecord, path: str, bit: int) -> tuple[str, int]:
    """(key, bit within that object) of bit ``bit`` of file ``path``."""
    entry = next(f for f in fetch_manifest(store, record).files if f.path == path)
    if entry.chunks is None:
        return record.ckpt + attempt_layout.FILES_DIR + path, bit
    offset = 0
    for chunk in entry.chunks:
        if offset * 8 <= bit < (offset + chunk.size) * 8:
            return chunk.key, bit - offset * 8
        offset += chunk.size
    raise ValueError(f"{path} has no bit {bit}")
