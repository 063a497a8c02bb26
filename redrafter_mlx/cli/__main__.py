"""``python -m redrafter_mlx.cli``: the same as the ``redrafter-mlx`` command."""

from redrafter_mlx.cli import main

main()
