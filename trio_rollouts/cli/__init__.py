"""The ``trio-rollouts`` command line: ``demo``, ``generate``, ``eval`` and ``eval-merge``.

Each command lives in its own module (:mod:`.demo`, :mod:`.generate`, :mod:`.evaluate`,
:mod:`.eval_merge`) and builds the library's objects (an agent, an inference interface, a
request), runs them in one ``trio.run``, shows progress with rich on stderr and a summary
table on stdout. What they share (running Trio, exit codes, error lines, the server
options, the ``--out`` rule) is in :mod:`._common`, the job record of ``--resume`` in
:mod:`._job`. Exit codes: 0 done, 1 error (one ``Error: ...`` line), 2 bad usage, 130
Ctrl-C, 143 SIGTERM. The prompt file format is documented in
:mod:`trio_rollouts.prompts._file`.
"""

from __future__ import annotations

import click

from trio_rollouts import __version__
from trio_rollouts.cli._common import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from trio_rollouts.cli._common import EXIT_TERMINATED as EXIT_TERMINATED
from trio_rollouts.cli.demo import demo as demo
from trio_rollouts.cli.eval_merge import eval_merge as eval_merge
from trio_rollouts.cli.evaluate import EVAL_FORMAT as EVAL_FORMAT
from trio_rollouts.cli.evaluate import eval_command as eval_command
from trio_rollouts.cli.generate import generate as generate

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="trio-rollouts")
def main() -> None:
    """Generate and evaluate grouped RL rollouts with trio_rollouts.

    Exit codes: 0 done, 1 error, 2 bad usage, 130 interrupted (Ctrl-C), 143 terminated
    (SIGTERM).
    """


main.add_command(demo)
main.add_command(generate)
main.add_command(eval_command)
main.add_command(eval_merge)
