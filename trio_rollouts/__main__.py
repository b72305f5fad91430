"""``python -m trio_rollouts``: the ``trio-rollouts`` command line."""

from .cli import main

main()
