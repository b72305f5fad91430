"""What the benchmark scripts share: the machine and library header, progress lines, the
machine's busy CPU time, and tables printed with rich (plain text without it).

Imported as ``_report`` by the scripts in this folder (run as ``python benchmarks/X.py``,
which puts the folder on ``sys.path``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import trio

import trio_rollouts as tr

__all__ = [
    "Report",
    "busy_cpu_seconds",
    "cpu_model",
    "library_fingerprint",
    "machine_lines",
    "progress",
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown"


def machine_lines(versions: str) -> list[str]:
    """The header every benchmark prints: the machine, the interpreter, ``versions`` (of
    the libraries the benchmark compares), and which state of trio_rollouts ran."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    return [
        f"machine: nproc={os.cpu_count()} (usable {affinity}), CPU: {cpu_model()}",
        f"python {platform.python_version()} ({platform.python_implementation()}), "
        f"trio {trio.__version__}, {versions}, trio_rollouts {tr.__version__}",
        f"library: {library_fingerprint()}",
    ]


def library_fingerprint() -> str:
    """Which state of trio_rollouts ran: the commit and a hash of the sources as they are
    on disk (the working tree may differ from the commit)."""
    package = Path(tr.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=package,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    return f"{package} (commit {commit}, sources sha256 {digest.hexdigest()[:12]})"


def busy_cpu_seconds() -> float | None:
    """CPU seconds all cores spent busy so far (steal included), from /proc/stat; ``None``
    where there is none. Sampled around a run, it says how much other work shared the
    machine."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Report:
    """Prints tables with rich when it is installed, as plain text otherwise; ``width``
    is the console's when output is not a terminal."""

    def __init__(self, width: int = 132) -> None:
        try:
            from rich.console import Console
        except ImportError:
            self.console = None
        else:
            self.console = Console(width=None if sys.stdout.isatty() else width)

    def line(self, text: str = "") -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            print(text)

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:
        if self.console is not None:
            from rich.table import Table

            table = Table(title=title, title_justify="left")
            for i, name in enumerate(header):
                table.add_column(name, justify="left" if i == 0 else "right")
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        print(title)
        for row in [header, ["-" * w for w in widths], *rows]:
            cells = zip(row, widths, strict=True)
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells)))
        print()
