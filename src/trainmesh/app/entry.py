"""The ``trainmesh`` command's first step: say what is starting before torch is imported (a second or more on
a busy machine), then hand over to :mod:`trainmesh.app.cli`."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

STARTS = {"train": "checking the run before any rank starts", "launch": "starting the ranks"}
"""What the commands that start ranks say first; the others print their answer or nothing."""


def first_line(argv: Sequence[str]) -> str | None:
    """The line a command prints first, or None: for ``--help``, which prints straight away, and for a rank,
    whose launcher has already said it."""
    command = argv[0] if argv else ""
    if command not in STARTS or {"-h", "--help"} & set(argv) or "RANK" in os.environ:
        return None
    return f"trainmesh {command}: {STARTS[command]}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    line = first_line(argv)
    if line:
        print(line, flush=True)
    from trainmesh.app.cli import main as cli_main

    return cli_main(argv)
