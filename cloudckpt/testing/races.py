"""The two races every store probe runs, independent of the client library: racing
create-only writes of one new key, and compare-and-swap increments of one counter. The
probes (``s3_probe``, ``azure_probe``) supply the calls; an answer is the probe's string
for the outcome (its success string, or e.g. ``"412 PreconditionFailed"``)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def clients_of(make_client: Callable[[], Any], n: int) -> Iterator[list[Any]]:
    """``n`` clients from ``make_client``, each closed at the end."""
    clients = [make_client() for _ in range(n)]
    try:
        yield clients
    finally:
        for c in clients:
            c.close()


def run_together(clients: list[Any], fn: Callable[[Any, int], Any]) -> list:
    """``fn(client_i, i)`` in one thread per client, released together by a barrier."""
    barrier = threading.Barrier(len(clients))

    def run(i: int) -> Any:
        barrier.wait()
        return fn(clients[i], i)

    with cf.ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(run, range(len(clients))))


def race_creates(
    clients: list[Any],
    keys: Iterable[str],
    create: Callable[[Any, str, bytes], str],
    read: Callable[[Any, str], bytes],
    ok: str,
) -> tuple[list[int], dict[str, int], float, int]:
    """For each key (one round each), every client creates it at once with body
    ``writer-<i>``. Returns the number of winners of each round, how the losers were
    answered, the slowest single answer (seconds), and the number of rounds whose stored
    bytes are not the (single) winner's."""
    winners: list[int] = []
    losers: dict[str, int] = {}
    slowest = 0.0
    wrong_bytes = 0
    for key in keys:

        def timed(client: Any, i: int, key: str = key) -> tuple[str, float]:
            start = time.monotonic()
            answer = create(client, key, b"writer-%d" % i)
            return answer, time.monotonic() - start

        answers = run_together(clients, timed)
        won = [i for i, (a, _) in enumerate(answers) if a == ok]
        winners.append(len(won))
        slowest = max([slowest, *(t for _, t in answers)])
        for a, _ in answers:
            if a != ok:
                losers[a] = losers.get(a, 0) + 1
        stored = read(clients[0], key)
        if len(won) != 1 or stored != b"writer-%d" % won[0]:
            wrong_bytes += 1
    return winners, losers, slowest, wrong_bytes


def race_cas(
    clients: list[Any],
    read: Callable[[Any], tuple[bytes, str]],
    put_if: Callable[[Any, bytes, str], str],
    ok: str,
    increments: int,
) -> tuple[int, int]:
    """Every client makes ``increments`` increments of one counter: ``read`` returns its
    bytes and version, ``put_if`` writes the new bytes if the version is still current.
    Returns (acknowledged increments, retries after a lost race: 412 or 409)."""
    lock = threading.Lock()
    retries = [0]
    limit = increments * len(clients) * 50

    def worker(client: Any, i: int) -> int:
        done = attempts = 0
        while done < increments:
            attempts += 1
            if attempts > limit:
                raise RuntimeError("compare-and-swap never succeeds")
            body, version = read(client)
            time.sleep(0.001)  # a read-modify-write window like a real network's
            answer = put_if(client, b"%d" % (int(body) + 1), version)
            if answer == ok:
                done += 1
            elif answer.startswith(("412", "409")):
                with lock:
                    retries[0] += 1
            else:
                raise RuntimeError(f"compare-and-swap answered {answer}")
        return done

    return sum(run_together(clients, worker)), retries[0]
