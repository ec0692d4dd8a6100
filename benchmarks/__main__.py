"""``python -m benchmarks``: see ``benchmarks/run.py`` and docs/performance.md.

``python -m benchmarks gpu ...`` runs ``benchmarks/gpu.py`` (checkpoints on an accelerator;
it imports nothing but torch, numpy, safetensors and cloudckpt's own dependencies).
"""

import sys

if sys.argv[1:2] == ["gpu"]:
    from benchmarks.gpu import main as gpu_main

    raise SystemExit(gpu_main(sys.argv[2:]))

from benchmarks.run import main

raise SystemExit(main())
