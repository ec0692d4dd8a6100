"""Framework integrations. Each module imports its framework only when it is imported.

- ``cloudckpt.integrations.torch``: ``save_state`` / ``load_state`` for nested state dicts
  (reused host buffers, safetensors, no pickle for tensors and plain values).
- ``cloudckpt.integrations.hf``: ``CheckpointCallback`` for the transformers ``Trainer`` and
  ``resume()`` for ``trainer.train(resume_from_checkpoint=...)``.
- ``cloudckpt.integrations.lightning``: ``CloudCheckpointIO`` for ``Trainer(plugins=[...])``,
  ``PreemptionCallback``, ``RNGStateCallback`` and ``resume()`` for ``fit(ckpt_path=...)``.

Install the matching extra: ``pip install 'cloudckpt[torch]'``, ``'cloudckpt[hf]'`` or
``'cloudckpt[lightning]'`` (torch itself is not pulled in: install the build you need first).
Preemption detection lives in ``cloudckpt.preemption`` and needs no framework.
"""
