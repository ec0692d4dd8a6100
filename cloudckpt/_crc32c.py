"""CRC32C of any contiguous buffer, without copying it.

``google_crc32c.value`` parses its argument with ``"y#"``, which accepts ``bytes`` only:
a ``memoryview`` of a reused part buffer or of ``save_state``'s host memory would first
have to be copied into a new ``bytes`` (for an 8 MiB part, the allocation's page faults
cost more CPU than the CRC itself). The same wheel ships the C library it wraps
(``libcrc32c``, hardware CRC32C where the CPU has it); its ``crc32c_extend`` takes a
pointer and a length. ``value`` calls it through ctypes on the buffer's own memory (the
GIL is released during the call, which ``google_crc32c`` does not do), and falls back to
``google_crc32c.value(bytes(data))`` where the library cannot be found (another wheel
layout), so the result is the same everywhere; only the cost differs.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import google_crc32c

_PyBUF_SIMPLE = 0


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable layout since Python 3.3)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _load() -> Any:
    """``crc32c_extend`` from the library ``google_crc32c`` links, or None."""
    if google_crc32c.implementation != "c":
        return None
    here = os.path.dirname(os.path.abspath(google_crc32c.__file__))
    patterns = [
        os.path.join(here, "..", "google_crc32c.libs", "libcrc32c*"),  # manylinux wheels
        os.path.join(here, ".dylibs", "libcrc32c*"),  # macOS wheels
        os.path.join(here, "*crc32c*.dll"),  # Windows wheels
    ]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                lib = ctypes.CDLL(path)
                fn = lib.crc32c_extend
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_uint32
            if fn(0, b"123456789", 9) == 0xE3069283:  # the CRC-32C check value
                return fn
    return None


_extend = _load()
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def value(data: bytes | bytearray | memoryview) -> int:
    """The CRC32C of ``data`` (any C-contiguous buffer). Raises BufferError for a
    non-contiguous one."""
    return extend(0, data)


def extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """The CRC32C of the bytes ``crc`` covers followed by ``data`` (to compute one CRC
    block by block, in the same pass as another hash). Raises BufferError for a
    non-contiguous buffer."""
    if _extend is None:
        return int(google_crc32c.extend(crc, data if type(data) is bytes else bytes(data)))
    view = _PyBuffer()
    if _get_buffer(data, ctypes.byref(view), _PyBUF_SIMPLE) != 0:  # pragma: no cover
        raise BufferError("cannot take the buffer of a non-contiguous object")
    try:
        return int(_extend(crc, view.buf, view.len))
    finally:
        _release_buffer(ctypes.byref(view))
