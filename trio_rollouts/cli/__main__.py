"""``python -m trio_rollouts.cli``: the ``trio-rollouts`` command line."""

from trio_rollouts.cli import main

main()
