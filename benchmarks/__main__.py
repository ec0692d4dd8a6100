"""``python -m benchmarks``: see ``benchmarks/run.py`` and docs/performance.md."""

from benchmarks.run import main

raise SystemExit(main())
