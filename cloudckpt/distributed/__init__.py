"""Multi-rank checkpoints on ``torch.distributed``: every rank uploads, one commit.

::

    import torch.distributed as dist
    from cloudckpt.distributed import DistributedCheckpointManager

    dist.init_process_group("nccl")          # or "gloo"; torchrun sets the environment
    mgr = DistributedCheckpointManager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    restored = mgr.resume(into="/nvme/restore")           # every rank; None for a new run
    if restored is not None:
        shard = torch.load(restored.rank_path / "shard.pt")
    ...
    with mgr.save(step) as d:                             # every rank, same steps, same order
        torch.save(my_shard, d / "shard.pt")              # stored as rank-<rank>/shard.pt
    ...
    mgr.close()                                           # every rank

How a save runs (docs/design.md §5.3). Each rank stages its files locally and returns to training;
its background thread then takes part in a fixed sequence of collectives on a **dedicated
gloo group** that the manager creates at construction, so they never interleave with the
training loop's own collectives (NCCL or gloo), and never with another manager's:

1. every rank fsyncs its staged files and sends the coordinator (rank 0 of the group) its
   step and file paths; the coordinator checks that every rank saves the same step, that no
   two ranks write the same path (nor a file where another writes a directory), claims the
   run if it has not yet (fencing zombies), picks the attempt prefix and writes
   ``ATTEMPT.json``; it broadcasts the prefix (or the error, which every rank raises);
2. every rank uploads its own files into that one prefix, in parallel with the others,
   while the ranks exchange a small heartbeat every second: a rank that fails stops the
   others' uploads early and every rank learns who failed and why;
3. every rank sends the coordinator its files' (path, size, digest); only when every rank
   succeeded, and the ranks of each ``replica_groups`` group saved the same bytes
   (``_replicas``), does the coordinator write the manifest and commit it with the fenced
   compare-and-swap of LATEST; it broadcasts the outcome, so every rank's handle returns
   the same ``CommitInfo`` or raises the same error.

A rank that fails before the commit means no commit: every rank's handle raises
``RankFailedError`` naming the failed ranks. A rank that dies or hangs cannot make the others
wait forever: every collective of the group gives up after ``timeout`` seconds (gloo notices a
dead peer's closed connection at once; ``timeout`` covers a hung process or a lost node), and
the surviving ranks raise ``CollectiveError``, naming the ranks that never reached the
collective. After that the group is unusable and the manager refuses further saves:
restart the job (its last committed checkpoint is intact).

Restores (``resume()`` and ``restore()``, collective): rank 0 claims (``resume`` only) and
picks the checkpoint; one rank per node (the lowest rank among those sharing a host and
boot, or the same ``node_id``) downloads what the node's ranks need, once, verified, into
the node-local ``into`` directory; the other ranks of the node wait and then read from it.
With per-rank directories and the same world size, a node fetches only its ranks'
``rank-<r>/`` directories plus the shared files; otherwise (different world size, or user
paths) every node fetches everything, unless ``select`` says otherwise. After each commit
every rank keeps its files in its staging directory (``keep_local``, as on one host), and a
restore on the same node takes them from there, every byte verified against the committed
manifest, downloading only what is missing or damaged (``_kept``).

Rules: construct, save, resume, restore and close the manager on every rank of the group, in
the same order (saves are sequential, so the collectives line up). ``backpressure`` must be
``"block"``: dropping a save on one rank but not another would misalign them. Staged saves
of a crashed job are abandoned, not recovered (each rank would have to agree on them).

Where things live (private modules; this package exports what users import):
``_comm`` the collectives and the typed messages that carry errors between ranks,
``_save`` the multi-rank save, ``_chunks`` each rank's chunk index and the owners of chunks
several ranks hold, ``_replicas`` replica agreement, ``_restore`` the multi-rank restore,
``_kept`` each rank's local copies and a node's restore from them, ``_manager`` the
manager that queues saves and calls them. (The DCP reader streams each rank's plan on its
own: ``cloudckpt.integrations.dcp``.)
"""

from cloudckpt.distributed._manager import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from cloudckpt.distributed._manager import DistributedCheckpointManager
from cloudckpt.distributed._restore import DistributedRestoreResult, rank_dir
from cloudckpt.distributed._save import WORLD_SIZE_KEY
from cloudckpt.errors import CollectiveError, RankFailedError, ReplicaDivergedError

__all__ = [
    "WORLD_SIZE_KEY",
    "CollectiveError",
    "DistributedCheckpointManager",
    "DistributedRestoreResult",
    "RankFailedError",
    "ReplicaDivergedError",
    "rank_dir",
]
