"""``python -m trio_rollouts.cli``: the ``trio-rollouts`` command line."""

from . import main

main()
