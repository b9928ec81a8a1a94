"""CUDA graphs for the compiled step: whether a layout's compiled blocks can be captured, and the
``torch.compile`` mode that follows. ``reduce-overhead`` replays each graph with one launch instead of a
host-bound stream of launches (docs/performance.md), but needs fixed shapes and addresses and no host
sync; :func:`capture_problem` says where a layout breaks that, and the run says why once."""

from __future__ import annotations

from trainmesh.layout import Layout

GRAPHS_MODE = "reduce-overhead"
PLAIN_MODE = "default"


def capture_problem(layout: Layout, device_type: str, moe: bool = False) -> str | None:
    """Why the compiled blocks of ``layout`` on a ``device_type`` device cannot be CUDA graphs, or None;
    ``moe``: the model has mixture-of-experts layers."""
    if device_type != "cuda":
        return f"CUDA graphs replay GPU kernels and the ranks run on {device_type}"
    if moe:
        return ("MoE routing sends a data-dependent number of tokens to each expert, so shapes change from "
                "step to step")
    if layout.pp > 1:
        return ("the pipeline's point-to-point messages run between the compiled blocks and its micro-batches' "
                "activations stay alive across replays, which would overwrite them")
    if layout.zero == 3:
        return ("ZeRO-3 gathers and frees each block's parameters around its forward, so their addresses "
                "change every step and every replay would re-record")
    if layout.tp > 1:
        return "tensor parallelism's collectives run inside each compiled block"
    return None


def compile_mode(layout: Layout, device_type: str, moe: bool = False) -> tuple[str, str | None]:
    """``(torch.compile mode, why CUDA graphs are off)`` for a run that asked for CUDA graphs: graphs
    (``reduce-overhead``) where :func:`capture_problem` finds nothing, else plain compilation and its reason."""
    problem = capture_problem(layout, device_type, moe)
    return (PLAIN_MODE, problem) if problem else (GRAPHS_MODE, None)
