"""``python -m trio_rollouts``: the ``trio-rollouts`` command line."""

from trio_rollouts.cli import main

main()
