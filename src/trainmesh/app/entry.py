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


def quiet_store_warnings(argv: Sequence[str]) -> None:
    """``launch --nnodes MIN:MAX``: torch's C++ store client logs each connection a lost node broke as a warning
    with ~30 ``frame #`` lines, read once, when torch loads; the agent's own one-line reports say what happened
    (an explicit ``TORCH_CPP_LOG_LEVEL`` is kept)."""
    pairs = zip(argv, [*argv[1:], ""])
    ranged = any((a == "--nnodes" and ":" in b) or (a.startswith("--nnodes=") and ":" in a) for a, b in pairs)
    if argv[:1] == ["launch"] and ranged:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_store_warnings(argv)
    line = first_line(argv)
    if line:
        print(line, flush=True)
    from trainmesh.app.cli import main as cli_main

    return cli_main(argv)
