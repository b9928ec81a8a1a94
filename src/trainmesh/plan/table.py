"""The search's answer for people and for programs: a text table of the fastest layouts with the chosen
one's command line and why it splits what it splits (:func:`format_table`), or the same as JSON."""

from __future__ import annotations

import dataclasses
import json

from trainmesh.distributed.hardware import GIB, Cluster
from trainmesh.plan.dp_traffic import DpTraffic, dp_traffic
from trainmesh.plan.memory import active_params, activation_bytes, candidate_stages, memory_per_rank
from trainmesh.plan.ranking import TIE_TOLERANCE, Estimate, runner_up
from trainmesh.plan.workload import Workload, micro_batch_size, moe_tokens, stage_split


def scaled(value: float, steps: tuple[str, ...], base: int) -> str:
    """``value`` with the largest unit of ``steps`` (each ``base`` times the previous) that keeps it >= 1."""
    exponent = 0
    while exponent < len(steps) - 1 and abs(value) >= base ** (exponent + 1):
        exponent += 1
    return f"{value / base**exponent:.1f}{steps[exponent]}"


def apart(a: float, b: float) -> tuple[str, str]:
    """Byte counts ``a`` and ``b`` in one unit at a precision that tells them apart: one decimal, else two, else
    the next smaller unit (15.04 GiB against 14.97 GiB, never 15.0 against 15.0); equal values read equal."""
    top = 0
    while top < len(GIB_UNITS) - 1 and max(abs(a), abs(b)) >= 1024 ** (top + 1):
        top += 1
    tries = [(top, 1), (top, 2), *((e, 1) for e in range(top - 1, -1, -1))]
    for e, digits in tries:
        texts = tuple(f"{v / 1024**e:.{digits}f}{GIB_UNITS[e]}" for v in (a, b))
        if texts[0] != texts[1]:
            return texts
    return (f"{a / 1024**top:.1f}{GIB_UNITS[top]}",) * 2


def _row(workload: Workload, cluster: Cluster, e: Estimate, chosen: Estimate | None) -> list[str]:
    lay = e.layout
    sched = f"{lay.schedule}x{lay.virtual_stages}" if lay.virtual_stages > 1 else lay.schedule
    layout = [lay.dp, lay.cp, lay.tp, lay.pp, *([lay.ep] if workload.model.n_experts else []), lay.zero,
              lay.dp_replicate, micro_batch_size(workload, lay), lay.microbatches, sched,
              compact_split(stage_split(workload, lay)), lay.recompute, "y" if lay.sequence_parallel else "n"]
    measures = [scaled(step_dp_traffic(workload, cluster, e).inter, BYTE_UNITS, 1000),
                scaled(e.memory.total, GIB_UNITS, 1024), f"{e.time.total:.4g}", f"{e.mfu:.1%}",
                f"{e.tokens_per_s:,.0f}"]
    return ["*" if e is chosen else ""] + [str(c) for c in layout] + measures


GIB_UNITS = (" B", " KiB", " MiB", " GiB", " TiB")
BYTE_UNITS = (" B", " kB", " MB", " GB", " TB")


def step_dp_traffic(workload: Workload, cluster: Cluster, e: Estimate) -> DpTraffic:
    """The data-parallel traffic of the stage whose traffic takes longest (the one the step time counts)."""
    return max((dp_traffic(workload, e.layout, cluster, s) for s in candidate_stages(workload, e.layout)),
               key=lambda t: t.seconds)


def compact_split(split: tuple[int, ...]) -> str:
    """Blocks per pipeline chunk with runs folded: ``7,8x14,7``."""
    runs: list[list[int]] = []
    for n in split:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)


def format_table(workload: Workload, cluster: Cluster, estimates: list[Estimate], chosen: Estimate | None,
                 command: list[str], top: int = 20, precision_note: str = "") -> str:
    """The ``top`` fastest layouts as a table (chosen ``*``; ``R`` is ``--dp-replicate``, ``dp x-node`` dp bytes across
    nodes), why the choice won, and ``command`` that runs it (empty when nothing fits)."""
    head = ["", "dp", "cp", "tp", "pp", *(["ep"] if workload.model.n_experts else []), "zero", "R", "mbs", "m",
            "schedule", "blocks/stage", "recompute", "sp", "dp x-node", "mem/rank", "step s", "MFU", "tokens/s"]
    pair = zero3_against_hsdp(workload, cluster, estimates) or ()
    shown = estimates[:top]
    shown += [e for e in dict.fromkeys((chosen, *pair)) if e is not None and e not in shown]
    rows = [head] + [_row(workload, cluster, e, chosen) for e in shown]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    m = workload.model
    params = scaled(m.n_params(), ("", "K", "M", "B", "T"), 1000)
    if m.n_experts:
        params += f" ({scaled(active_params(m), ('', 'K', 'M', 'B', 'T'), 1000)} active)"
    title = (f"{params} params, batch {workload.global_batch} x {workload.seq_len}, precision {workload.precision}"
             f"{precision_note}, {cluster.gpus} devices of {cluster.mem_bytes / GIB:.0f} GiB: {len(estimates)} "
             f"layouts fit, fastest first")
    if chosen is None:
        return "\n".join([title, "chosen: none fits"])
    whys = [why for why in (explain_choice(workload, cluster, estimates, chosen), explain_cp(workload, estimates, chosen),
                            explain_ep(workload, estimates, chosen), explain_hsdp(workload, cluster, estimates, chosen))
            if why]
    table = ("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
    return "\n".join([title, *table, *whys, "chosen (*), the command that runs it:", *command])


def layout_name(workload: Workload, e: Estimate) -> str:
    """A layout in one phrase, as the table's columns give it."""
    lay = e.layout
    sched = (f" {lay.schedule}" + (f"x{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
             + f" blocks/stage {compact_split(stage_split(workload, lay))}" if lay.pp > 1 else "")
    extra = ((f" cp={lay.cp}" if lay.cp > 1 else "") + (f" ep={lay.ep}" if lay.ep > 1 else "")
             + (f" dp_replicate={lay.dp_replicate}" if lay.dp_replicate > 1 else ""))
    return (f"dp={lay.dp} tp={lay.tp} pp={lay.pp}{extra} zero={lay.zero} mbs={micro_batch_size(workload, lay)}"
            f"{sched} recompute={lay.recompute}{' sp' if lay.sequence_parallel else ''}")


# TimeBreakdown fields and what each is, for saying where two layouts' step times differ.
TIME_PARTS = {"compute": "compute", "bubble": "pipeline bubble", "dp_comm": "data-parallel traffic",
              "tp_comm": "tensor-parallel traffic", "pp_comm": "pipeline sends", "cp_comm": "exposed cp traffic",
              "ep_comm": "expert all-to-all"}


def explain_choice(workload: Workload, cluster: Cluster, estimates: list[Estimate], chosen: Estimate) -> str:
    """Why ``chosen`` beat the runner-up: within :data:`TIE_TOLERANCE`, its memory headroom; else the parts of the step
    where it saves most time, and both headrooms."""
    other = runner_up(estimates, chosen)
    if other is None:
        return "why: it is the only layout that fits"
    free = apart(*(cluster.usable_bytes - e.memory.total for e in (chosen, other)))
    headroom = f"{free[0]} free per rank against {free[1]}"
    versus = f"the runner-up ({layout_name(workload, other)}, {other.time.total:.4g} s/step)"
    if other.time.total <= chosen.time.total:
        faster = chosen.time.total / other.time.total - 1
        pace = f"{faster:.1%} faster, within the {TIE_TOLERANCE:.0%} the model can tell apart," if faster else "as fast"
        return f"why: {versus} is predicted {pace} and the chosen one keeps more headroom: {headroom}"
    gains = {part: getattr(other.time, part) - getattr(chosen.time, part) for part in TIME_PARTS}
    best = sorted((g, part) for part, g in gains.items() if g > 0)[::-1][:2]
    saved = ", ".join(f"{g:.3g} s less {TIME_PARTS[part]}{_slow_link(workload, cluster, chosen, other, part)}"
                      for g, part in best)
    return (f"why: {chosen.time.total:.4g} s/step against {versus}: {saved or 'the same parts, each shorter'}; "
            f"headroom {headroom}")


def _slow_link(workload: Workload, cluster: Cluster, chosen: Estimate, other: Estimate, part: str) -> str:
    """For the data-parallel part, when either layout's crosses nodes: the bytes each sends per rank and step
    over the inter-node link, the slow one."""
    if part != "dp_comm":
        return ""
    mine, theirs = (step_dp_traffic(workload, cluster, e).inter for e in (chosen, other))
    if not mine and not theirs:
        return ""
    return (f" ({scaled(mine, BYTE_UNITS, 1000)} per rank over the inter-node link against the runner-up's "
            f"{scaled(theirs, BYTE_UNITS, 1000)})")


def zero3_against_hsdp(workload: Workload, cluster: Cluster,
                       estimates: list[Estimate]) -> tuple[Estimate, Estimate] | None:
    """The fastest ZeRO-3 layout under hybrid sharding and the same layout over its whole dp group (which fits too):
    they differ only in where their bytes go. None unless the search found both."""
    hybrid = next((e for e in estimates if e.layout.zero == 3 and e.layout.dp_replicate > 1), None)
    if hybrid is None:
        return None
    flat = dataclasses.replace(hybrid.layout, dp_replicate=1)
    return next(((e, hybrid) for e in estimates if e.layout == flat), None)


def explain_hsdp(workload: Workload, cluster: Cluster, estimates: list[Estimate], chosen: Estimate) -> str:
    """ZeRO-3 over the whole dp group against ZeRO-3 under hybrid sharding (empty without both): each one's step, dp
    bytes across and inside nodes, memory, and which is faster and why."""
    pair = zero3_against_hsdp(workload, cluster, estimates)
    if pair is None:
        return ""
    flat, hybrid = pair
    traffic = {e.layout: step_dp_traffic(workload, cluster, e) for e in pair}

    def described(e: Estimate) -> str:
        t = traffic[e.layout]
        return (f"{layout_name(workload, e)}: {e.time.total:.4g} s/step, {scaled(t.inter, BYTE_UNITS, 1000)} per "
                f"rank across nodes and {scaled(t.intra, BYTE_UNITS, 1000)} inside, "
                f"{scaled(e.memory.total, GIB_UNITS, 1024)}/rank")
    off = traffic[flat.layout].inter - traffic[hybrid.layout].inter
    if hybrid.time.total < flat.time.total:
        verdict = (f"HSDP is {flat.time.total - hybrid.time.total:.3g} s/step faster: it moves "
                   f"{scaled(off, BYTE_UNITS, 1000)} per rank off the inter-node link")
    else:
        why = ("HSDP moves no fewer bytes across nodes" if off <= 0
               else "its gathers run behind the compute, and HSDP's replica all-reduce does not"
               if flat.time.dp_comm < hybrid.time.dp_comm
               else "HSDP's larger shards leave it only slower layouts")
        verdict = f"ZeRO-3 over all ranks is {hybrid.time.total - flat.time.total:.3g} s/step faster: {why}"
    lay = chosen.layout
    took = f"zero={lay.zero}" + (f" with HSDP dp_replicate={lay.dp_replicate}" if lay.dp_replicate > 1
                                  else " over all dp ranks")
    return (f"ZeRO-3 vs HSDP (both rows shown): over all dp ranks, {described(flat)}; HSDP, {described(hybrid)}; "
            f"{verdict}; the choice (*) shards with {took}")


def explain_cp(workload: Workload, estimates: list[Estimate], chosen: Estimate) -> str:
    """Why the chosen layout splits sequences over cp (empty when it does not): the activations it saves
    and the fastest layout without it."""
    if chosen.layout.cp == 1:
        return ""
    cp, gib = chosen.layout.cp, GIB_UNITS
    alone = activation_bytes(workload, dataclasses.replace(chosen.layout, cp=1))
    text = (f"why cp={cp}: each rank holds {workload.seq_len // cp:,} of a sequence's {workload.seq_len:,} tokens, "
            f"so its activations are {scaled(chosen.memory.activations, gib, 1024)} instead of "
            f"{scaled(alone, gib, 1024)} with the same layout at cp=1; ")
    return _beside_fastest_without("cp", estimates, chosen, text, "recompute",
                                   f"{chosen.time.cp_comm:.3g} s of it cp traffic the attention does not hide")


def explain_ep(workload: Workload, estimates: list[Estimate], chosen: Estimate) -> str:
    """Why the chosen layout splits the experts over ep (empty when it does not): the expert state it
    saves, the larger expert matmuls, and the fastest layout without it."""
    if chosen.layout.ep == 1:
        return ""
    m, lay, gib = workload.model, chosen.layout, GIB_UNITS
    alone = dataclasses.replace(lay, ep=1)
    tokens = moe_tokens(workload, lay) * m.top_k
    text = (f"why ep={lay.ep}: each rank holds {m.n_experts // lay.ep} of the {m.n_experts} routed experts of each "
            f"MoE layer, so its model state is {scaled(chosen.memory.model_state, gib, 1024)} instead of "
            f"{scaled(memory_per_rank(workload, alone).model_state, gib, 1024)} with the same layout at ep=1, "
            f"and each expert's matmuls take {lay.ep * tokens // m.n_experts:,} token rows per micro-batch "
            f"instead of {max(1, tokens // m.n_experts):,}; ")
    return _beside_fastest_without("ep", estimates, chosen, text, "zero", f"{chosen.time.ep_comm:.3g} s of it all-to-all")


def _beside_fastest_without(axis: str, estimates: list[Estimate], chosen: Estimate, text: str, knob: str,
                            traffic: str) -> str:
    """``text`` and the fastest layout with ``axis`` at 1 beside the chosen one, whose time includes
    ``traffic`` (the exposed communication of that axis)."""
    without = next((e for e in estimates if getattr(e.layout, axis) == 1), None)
    if without is None:
        return text + f"no layout without {axis} fits"
    lay = without.layout
    return text + (f"the fastest layout without {axis} (dp={lay.dp} tp={lay.tp} pp={lay.pp} "
                   f"{knob}={getattr(lay, knob)}) is predicted {without.time.total:.3g} s/step against {chosen.time.total:.3g} s ({traffic})")


def to_json(workload: Workload, cluster: Cluster, estimates: list[Estimate], chosen: Estimate | None,
            top: int = 20) -> str:
    """The same as :func:`format_table` as JSON, totals included, and each layout's data-parallel bytes per
    rank and step inside a node (``intra``) and across nodes (``inter``)."""
    def row(e: Estimate) -> dict[str, object]:
        return {
            "layout": dataclasses.asdict(e.layout),
            "memory": {**dataclasses.asdict(e.memory), "model_state": e.memory.model_state,
                       "total": e.memory.total},
            "time": {**dataclasses.asdict(e.time), "total": e.time.total},
            "dp_bytes_per_rank": {k: v for k, v in dataclasses.asdict(step_dp_traffic(workload, cluster, e)).items()
                                  if k != "seconds"},
            "mfu": e.mfu,
            "tflops_per_device": e.tflops_per_device,
            "tokens_per_s": e.tokens_per_s,
        }
    return json.dumps({"workload": dataclasses.asdict(workload), "cluster": dataclasses.asdict(cluster),
                       "fitting_layouts": len(estimates), "chosen": row(chosen) if chosen is not None else None,
                       "layouts": [row(e) for e in estimates[:top]]}, indent=2)


# ----------------------------------------------------------------------------------------------------------
