"""Framework integrations. Each module imports its framework only when it is imported.

- ``cloudckpt.integrations.torch``: ``save_state`` / ``load_state`` for nested state dicts
  (reused host buffers, safetensors, no pickle for tensors and plain values).
- ``cloudckpt.integrations.hf``: ``CheckpointCallback`` for the transformers ``Trainer`` and
  ``resume()`` for ``trainer.train(resume_from_checkpoint=...)``.
- ``cloudckpt.integrations.deepspeed``: ``save_checkpoint`` / ``load_checkpoint`` for a
  DeepSpeed engine, through a ``DistributedCheckpointManager``.
- ``cloudckpt.integrations.lightning``: ``CloudCheckpointIO`` for ``Trainer(plugins=[...])``,
  ``PreemptionCallback``, ``RNGStateCallback`` and ``resume()`` for ``fit(ckpt_path=...)``.

Install the matching extra from the root of a clone of the repository (cloudckpt is not
on the package index): ``pip install '.[torch]'``, ``pip install '.[hf]'`` or ``pip install
'.[lightning]'``. torch itself is not pulled in: install the build you need first.
Preemption detection lives in ``cloudckpt.preemption`` and needs no framework.
"""
