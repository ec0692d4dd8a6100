"""The actors of the simulation, one module per role. Each module's ``run(actor)`` is the
program of one simulated process; it runs in the actor's thread, reaches the store only
through ``actor.new_incarnation()`` (a fault-injecting ``Port``), and reports outcomes to
``actor.sim.checker``.

- ``writer``: the two writers (A, B), real ``CheckpointManager`` s; one becomes a zombie.
- ``collector``: garbage collection (``collect_garbage``).
- ``restorer``: restores, of the newest checkpoint or an older step.
- ``pinner``: ``admin.pin`` / ``admin.unpin``.
- ``finisher``: the final phase without faults (recovery, GC and restores converge).
- ``damage``: the damage the final phase injects (bit flips, forgeries, LATEST deleted).
- ``newer``: a newer cloudckpt commits a LATEST in a format this version does not know;
  every program of this version must refuse it and change nothing (final phase).
"""
