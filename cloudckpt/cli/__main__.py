"""``python -m cloudckpt.cli``: the same as the ``cloudckpt`` command."""

from cloudckpt.cli import main

main()
