"""``python -m cloudckpt.testing.simulation``: see ``cli.main``."""

import sys

from cloudckpt.testing.simulation.cli import main

if __name__ == "__main__":
    sys.exit(main())
