"""A zygote for the SIGKILL crash test (tests/test_crash_kill.py).

It imports cloudckpt and botocore once, then forks one saver process per command read
from stdin, so each of the many kill cycles skips the interpreter's start-up. A command
is one JSON line: {"url", "options", "staging", "log", "kill_seed"}; the reply is the
child's pid on one line. Children are reaped automatically (SIGCHLD ignored).

A saver child claims the run with ``resume()``, checks what it restored byte for byte,
then saves steps resume+1, resume+2, ... until it is killed. After ``handle.result()``
returns it appends ``ACK <step> <commit_id>`` to the log: the acknowledgement the parent
holds the store to. Other log lines: ``RESUMED <step>``, ``RECOVERING <step>``,
``BAD <why>`` (a check failed in the child).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import signal
import sys
from pathlib import Path

from cloudckpt import CheckpointManager, TransferConfig
from cloudckpt.stores import open_store


def content(step: int) -> dict[str, bytes]:
    """The files of checkpoint ``step`` (derived from the step, so anyone can check them)."""
    rng = random.Random(step)
    big = step % 4 == 0  # multipart (TRANSFER's threshold is 96 KiB)
    files = {
        "model.bin": rng.randbytes(
            rng.randint(100_000, 140_000) if big else rng.randint(20_000, 60_000)
        ),
        "optim/state.bin": rng.randbytes(rng.randint(0, 5_000)),
        "trainer_state.json": json.dumps({"step": step}).encode(),
    }
    if step % 7 == 0:
        files["extra/empty"] = b""
    # Frozen weights every checkpoint shares: stored once, as a chunk later saves name.
    files["base/frozen.bin"] = random.Random("frozen").randbytes(64_000)
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


TRANSFER = TransferConfig(concurrency=4, multipart_threshold=96 * 1024)


class _LogLines(logging.Handler):
    def __init__(self, write) -> None:
        super().__init__(logging.WARNING)
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("recovering step"):
            self.write(f"RECOVERING {message.split()[2]}")


def saver(cmd: dict) -> None:
    fd = os.open(cmd["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(line: str) -> None:
        os.write(fd, (line + "\n").encode())  # one write(2): whole line or nothing

    logging.getLogger("cloudckpt").addHandler(_LogLines(write))
    mgr = CheckpointManager(
        cmd["url"],
        storage_options=cmd["options"],
        staging_dir=cmd["staging"],
        keep_last=3,
        auto_gc=False,
        transfer=TRANSFER,
    )
    into = Path(cmd["staging"] + "-restore-" + str(os.getpid()))
    res = mgr.resume(into=into)
    step = 1
    if res is not None:
        if read_tree(res.path) != content(res.step) or res.skipped:
            write(f"BAD resumed step {res.step} does not match its content")
        write(f"RESUMED {res.step}")
        step = res.step + 1
    else:
        write("RESUMED 0")
    while True:
        handle = mgr.save(step=step, metadata={"step": step})
        with handle as d:
            for rel, data in content(step).items():
                path = d / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        info = handle.result()
        write(f"ACK {step} {info.commit_id}")
        step += 1


def main() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # no zombies
    # Warm what every child needs (botocore's S3 model), without opening a connection.
    warm = json.loads(sys.stdin.readline())
    open_store(warm["url"], warm["options"]).close()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                with contextlib.suppress(OSError, AttributeError):  # die with the zygote
                    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                sys.stdin.close()
                saver(cmd)
            except BaseException as exc:  # report, then die without cleanup
                with open(cmd["log"], "a") as f:
                    f.write(f"BAD child raised {type(exc).__name__}: {exc}\n")
            finally:
                os._exit(3)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
