"""The search's answer for people and for programs: a text table of the fastest layouts with the chosen
one's command line and why it splits what it splits (:func:`format_table`), or the same as JSON.
"""

from __future__ import annotations

import dataclasses
import json

from trainmesh.hardware import GIB, Cluster
from trainmesh.plan.memory import active_params, activation_bytes, memory_per_rank
from trainmesh.plan.ranking import Estimate
from trainmesh.plan.workload import Workload, micro_batch_size, moe_tokens


def scaled(value: float, steps: tuple[str, ...], base: int) -> str:
    """``value`` with the largest unit of ``steps`` (each ``base`` times the previous) that keeps it >= 1."""
    exponent = 0
    while exponent < len(steps) - 1 and abs(value) >= base ** (exponent + 1):
        exponent += 1
    return f"{value / base**exponent:.1f}{steps[exponent]}"


def _row(workload: Workload, e: Estimate) -> list[str]:
    lay = e.layout
    sched = f"{lay.schedule}x{lay.virtual}" if lay.virtual > 1 else lay.schedule
    layout = [lay.dp, lay.cp, lay.tp, lay.pp, *([lay.ep] if workload.model.n_experts else []), lay.zero,
              micro_batch_size(workload, lay), lay.microbatches, sched, lay.recompute,
              "y" if lay.sequence_parallel else "n"]
    measures = [scaled(e.memory.total, (" B", " KiB", " MiB", " GiB"), 1024), f"{e.time.total:.4g}",
                f"{e.mfu:.1%}", f"{e.tokens_per_s:,.0f}"]
    return [str(c) for c in layout] + measures


def format_table(workload: Workload, cluster: Cluster, estimates: list[Estimate], command: str | None,
                 top: int = 20) -> str:
    """The ``top`` fastest layouts as a text table, then the chosen one as ``command``, the command line
    that runs it (None when nothing fits)."""
    head = ["dp", "cp", "tp", "pp", *(["ep"] if workload.model.n_experts else []), "zero", "mbs", "m", "schedule",
            "recompute", "sp", "mem/rank", "step s", "MFU", "tokens/s"]
    rows = [head] + [_row(workload, e) for e in estimates[:top]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    m = workload.model
    params = scaled(m.n_params(), ("", "K", "M", "B", "T"), 1000)
    if m.n_experts:
        params += f" ({scaled(active_params(m), ('', 'K', 'M', 'B', 'T'), 1000)} active)"
    title = (f"{params} params, batch {workload.global_batch} x {workload.seq_len}, {workload.precision}, "
             f"{cluster.gpus} devices of {cluster.mem_bytes / GIB:.0f} GiB: {len(estimates)} layouts fit")
    chosen = f"chosen: {command}" if command is not None else "chosen: none fits"
    whys = [why for why in (explain_cp(workload, estimates), explain_ep(workload, estimates)) if why]
    return "\n".join([title, *("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows), chosen, *whys])


def explain_cp(workload: Workload, estimates: list[Estimate]) -> str:
    """Why the chosen layout splits sequences over cp (empty when it does not): the activations it saves
    and the fastest layout without it."""
    if not estimates or estimates[0].layout.cp == 1:
        return ""
    chosen = estimates[0]
    cp = chosen.layout.cp
    gib = (" B", " KiB", " MiB", " GiB", " TiB")
    alone = activation_bytes(workload, dataclasses.replace(chosen.layout, cp=1))
    text = (f"why cp={cp}: each rank holds {workload.seq_len // cp:,} of a sequence's {workload.seq_len:,} tokens, "
            f"so its activations are {scaled(chosen.memory.activations, gib, 1024)} instead of "
            f"{scaled(alone, gib, 1024)} with the same layout at cp=1; ")
    return _beside_fastest_without("cp", estimates, text, "recompute",
                                   f"{chosen.time.cp_comm:.3g} s of it cp traffic the attention does not hide")


def explain_ep(workload: Workload, estimates: list[Estimate]) -> str:
    """Why the chosen layout splits the experts over ep (empty when it does not): the expert state it
    saves, the larger expert matmuls, and the fastest layout without it."""
    if not estimates or estimates[0].layout.ep == 1:
        return ""
    chosen, m = estimates[0], workload.model
    lay, gib = chosen.layout, (" B", " KiB", " MiB", " GiB", " TiB")
    alone = dataclasses.replace(lay, ep=1)
    tokens = moe_tokens(workload, lay) * m.top_k
    text = (f"why ep={lay.ep}: each rank holds {m.n_experts // lay.ep} of the {m.n_experts} routed experts of each "
            f"MoE layer, so its model state is {scaled(chosen.memory.model_state, gib, 1024)} instead of "
            f"{scaled(memory_per_rank(workload, alone).model_state, gib, 1024)} with the same layout at ep=1, "
            f"and each expert's matmuls take {lay.ep * tokens // m.n_experts:,} token rows per micro-batch "
            f"instead of {max(1, tokens // m.n_experts):,}; ")
    return _beside_fastest_without("ep", estimates, text, "zero", f"{chosen.time.ep_comm:.3g} s of it all-to-all")


def _beside_fastest_without(axis: str, estimates: list[Estimate], text: str, knob: str, traffic: str) -> str:
    """``text`` and the fastest layout with ``axis`` at 1 beside the chosen one, whose time includes
    ``traffic`` (the exposed communication of that axis)."""
    without = next((e for e in estimates if getattr(e.layout, axis) == 1), None)
    if without is None:
        return text + f"no layout without {axis} fits"
    lay = without.layout
    return text + (f"the fastest layout without {axis} (dp={lay.dp} tp={lay.tp} pp={lay.pp} "
                   f"{knob}={getattr(lay, knob)}) is predicted {without.time.total:.3g} s/step against {estimates[0].time.total:.3g} s ({traffic})")


def to_json(workload: Workload, cluster: Cluster, estimates: list[Estimate], top: int = 20) -> str:
    """The same as :func:`format_table` as JSON, totals included."""
    def row(e: Estimate) -> dict[str, object]:
        return {
            "layout": dataclasses.asdict(e.layout),
            "memory": {**dataclasses.asdict(e.memory), "model_state": e.memory.model_state,
                       "total": e.memory.total},
            "time": {**dataclasses.asdict(e.time), "total": e.time.total},
            "mfu": e.mfu,
            "tflops_per_device": e.tflops_per_device,
            "tokens_per_s": e.tokens_per_s,
        }
    return json.dumps({
        "workload": dataclasses.asdict(workload),
        "cluster": dataclasses.asdict(cluster),
        "fitting_layouts": len(estimates),
        "chosen": row(estimates[0]) if estimates else None,
        "layouts": [row(e) for e in estimates[:top]],
    }, indent=2)


# ----------------------------------------------------------------------------------------------------------
