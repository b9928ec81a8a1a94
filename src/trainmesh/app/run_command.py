"""The command lines that start a planned run, as ``trainmesh plan`` prints them: ``trainmesh train`` on one
node, a ``torchrun`` line per node, or an sbatch script. The model is never dropped: a preset is
``--model``, a Hugging Face directory ``--init-hf``, a planner-only shape a line saying how to run it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

RDZV_PORT = 29500  # torchrun's default rendezvous port
HEAD_NODE = "HEAD_NODE"  # the placeholder the user fills with the first node's address


@dataclass(frozen=True)
class ModelSource:
    """Where ``trainmesh train`` gets the planned model: ``flags`` that name it (``--model PRESET``,
    ``--init-hf DIR``), or none and a ``note`` saying why the model cannot be named on the command line."""

    flags: tuple[str, ...] = ()
    note: str = ""


def planner_only(what: str) -> ModelSource:
    """A model ``trainmesh train`` cannot build: the layout flags still hold for one's own module."""
    return ModelSource(note=f"# {what} is a shape only the planner knows: trainmesh train builds no model of it. "
                            f"Run this layout on your own nn.Module with trainmesh.parallelize and these settings "
                            f"(docs/api.md); the flags below are the layout.")


@dataclass(frozen=True)
class NodeSpan:
    """How many nodes a run spans and the ranks on each."""

    count: int
    per_node: int


def _line(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def torchrun_words(nodes: NodeSpan, endpoint: str, run_id: str) -> list[str]:
    """``torchrun`` with the c10d rendezvous every node of a multi-node run needs (torchrun's own docs:
    the same ``--rdzv-endpoint`` and ``--rdzv-id`` on every node)."""
    return ["torchrun", "--nnodes", str(nodes.count), "--nproc-per-node", str(nodes.per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "-m", "trainmesh"]


def command_lines(source: ModelSource, flags: list[str], nodes: NodeSpan) -> list[str]:
    """The lines to paste: the model note if any, then ``trainmesh train --nproc N ...`` on one node, or the
    torchrun line to run on every node, the head node's address left as ``$HEAD_NODE`` (the shell stops
    with a message until it is set)."""
    notes = [source.note] if source.note else []
    if nodes.count == 1:
        return [*notes, _line(["trainmesh", "train", *source.flags, "--nproc", str(nodes.per_node), *flags])]
    endpoint = f"${{{HEAD_NODE}:?set {HEAD_NODE} to the address of the first node}}:{RDZV_PORT}"
    run = torchrun_words(nodes, "ENDPOINT", "${RUN_ID:-trainmesh}")
    line = _line([*run, "train", *source.flags, *flags])
    line = line.replace("ENDPOINT", f'"{endpoint}"').replace("'${RUN_ID:-trainmesh}'", '"${RUN_ID:-trainmesh}"')
    return [*notes, f"# on each of the {nodes.count} nodes, with {HEAD_NODE} set to the first node's address:", line]


def sbatch_script(source: ModelSource, flags: list[str], nodes: NodeSpan, job_name: str = "trainmesh") -> str:
    """An sbatch script that starts the run: one task per node, each a torchrun of ``nodes.per_node`` ranks,
    rendezvousing at the job's first node (``scontrol show hostnames``) under the job's id."""
    notes = [source.note] if source.note else []
    run = torchrun_words(nodes, "ENDPOINT", "RUN_ID")
    line = _line(["srun", *run, "train", *source.flags, *flags])
    line = line.replace("ENDPOINT", f'"${HEAD_NODE}:{RDZV_PORT}"').replace("RUN_ID", '"$SLURM_JOB_ID"')
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes.count}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nodes.per_node}",
        "#SBATCH --exclusive",
        *notes,
        "set -euo pipefail",
        f'{HEAD_NODE}=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        line,
        "",
    ])
