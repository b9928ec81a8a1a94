"""``trainmesh train`` as one process for a preset with its layer count replaced, which no preset names: how
``scripts/gpu_check.py`` trains a ``llama-7b``-class model (its width, heads and vocabulary) at the most layers
one GPU holds.

    python scripts/train_resized.py LAYERS [trainmesh train flags, --model among them, one rank]

The preset is registered under ``<model>-<LAYERS>l`` in this process, which then runs as the job's only rank
(``RANK=0``, as under torchrun), so nothing is spawned that would not know the name.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys

from trainmesh.app import cli
from trainmesh.models import preset, register_preset, spec_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resized(flags: list[str], layers: int) -> list[str]:
    """``flags`` with ``--model`` naming ``layers``-layer copy of its preset, registered here."""
    at = flags.index("--model") + 1
    base = flags[at]
    name = f"{base}-{layers}l"
    register_preset(spec_of(base), name, dataclasses.replace(preset(base), n_layers=layers))
    return [*flags[:at], name, *flags[at + 1:]]


def main(argv: list[str]) -> int:
    if len(argv) < 1 or not argv[0].isdigit() or "--model" not in argv:
        sys.exit("usage: train_resized.py LAYERS --model PRESET [trainmesh train flags]")
    flags = resized(argv[1:], int(argv[0]))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    return cli.main(["train", *flags])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
