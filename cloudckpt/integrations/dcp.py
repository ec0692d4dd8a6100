"""``torch.distributed.checkpoint`` (DCP) on object storage, committed through LATEST.

::

    import torch.distributed.checkpoint as dcp
    from cloudckpt.distributed import DistributedCheckpointManager
    from cloudckpt.integrations.dcp import CloudStorageReader, CloudStorageWriter

    mgr = DistributedCheckpointManager("s3://bucket/runs/exp1", staging_dir="/nvme/ckpt")
    reader = CloudStorageReader(mgr, claim=True)     # every rank; rank 0 claims the run
    if reader.step is not None:                      # None for a new run
        dcp.load(state, storage_reader=reader)       # any world size DCP can reshard to
    ...
    dcp.save(state, storage_writer=CloudStorageWriter(mgr, step=step))
    # or, overlapping the upload with training (pass a gloo group, as DCP asks):
    fut = dcp.async_save(state, storage_writer=CloudStorageWriter(mgr, step=step),
                         process_group=ckpt_group)

How a save maps onto DCP's storage-writer calls (the checkpoint's files are exactly a DCP
``FileSystemWriter`` directory: ``__<rank>_<n>.distcp`` and ``.metadata``):

- ``set_up_storage_writer`` / ``prepare_local_plan`` (every rank): a fresh local staging
  directory under the manager's staging area; a DCP ``FileSystemWriter`` writes into it.
- ``prepare_global_plan`` (coordinator): checks every rank saves the same step, claims the
  run if needed, opens the attempt (``ckpt/<step>-e<epoch>-<id>/ATTEMPT.json``) and sends
  its prefix to every rank inside the plans DCP scatters.
- ``write_data`` (every rank): writes the rank's items locally, uploads its files into the
  attempt as content-addressed 8 MiB chunks (whole files, multipart, with
  ``chunking="off"``) and returns ``WriteResult``s whose ``storage_data`` carries, besides
  DCP's own storage info, each file's manifest entry (path, size, digest, chunks). The
  chunks are what lets a reader verify any part of a file on its own.
- ``finish`` (coordinator, only if every rank's ``write_data`` succeeded: DCP gathers their
  results and raises on every rank otherwise): writes ``.metadata`` (DCP's own format, with
  DCP's storage info only), uploads it, writes the manifest of every rank's files plus
  ``.metadata``, and commits with the fenced compare-and-swap of LATEST.

So a failed rank means no commit, and DCP raises ``CheckpointException`` on every rank. DCP's
collectives run on DCP's process group (``dcp.save(process_group=...)``; set its timeout
when you create it); cloudckpt adds none during a save. ``async_save`` works with the default
thread executor (DCP stages the state dict in CPU memory, then everything above runs in the
background); the process executor is not supported (the writer holds threads and clients).
Use one writer per save (``CloudStorageWriter(mgr, step=step)`` is cheap), or wait for one
save to finish before the next starts with the same writer.

Loading: the reader is built on every rank (collective): rank 0 picks the newest committed
checkpoint (or ``step``), checks its manifest and every object's size, falls back to an
older one if it is damaged, and hands every rank the verified ``.metadata``. In
``read_data`` every rank streams what its own plan reads, with no local file
(``cloudckpt.fetch``): the byte ranges of its items, grouped by file and read with parallel
ranged GETs into one buffer per stored item; of a chunked file only the chunks those ranges
touch, each fetched once and checked against its SHA-256 as it lands (the file's digest is
checked from the manifest's chunk list); a file stored whole (``chunking="off"``, or a
checkpoint from before chunked DCP saves) is read whole to check its digest, keeping only
the planned ranges. Items are then decoded and copied into the planned tensors as DCP's
``FileSystemReader`` does, and only once every byte the plan reads verified: a plan longer
than one window has its later windows read once first, verified and kept nowhere, so a
damaged chunk in a later window fails the load with the planned tensors untouched. Memory:
the items of one window (``read_window_bytes``, 512 MiB by default, or one item if larger; a
whole-file checkpoint's items of one file at once) plus the fetch engine's scratch buffers;
the bytes beyond the first window are read twice. Loading at another world size works as far as
DCP's planner reshards (DTensor and plain tensors).
"""

from cloudckpt.integrations._dcp_common import DCP_KEY, METADATA_FILE
from cloudckpt.integrations._dcp_reader import CloudStorageReader
from cloudckpt.integrations._dcp_writer import CloudStorageWriter

__all__ = ["DCP_KEY", "METADATA_FILE", "CloudStorageReader", "CloudStorageWriter"]
