"""``make bench-cp``: context parallelism on ``small`` at cp 1, 2 and 4, measured against the planner and
the byte formulas. Prints; asserts nothing.

Parts ``memory``, ``fit``, ``overlap`` and ``torch`` (``--parts``) run in the same warm processes of cp
ranks per degree (:func:`cp_rank`); what each measures: docs/performance.md."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

from trainmesh import api
from trainmesh.distributed.comm import Comm, log_all_reduce
from trainmesh.parallel.context_parallel import AXIS, RingTimeline, ring_attention
from trainmesh.distributed.mesh import Mesh
from trainmesh.tracking.metrics import SavedActivations
from trainmesh.models import preset, spec_of
from trainmesh.plan import Layout, cp_bytes_per_micro, memory_per_rank, micro_batch_activation_bytes
from trainmesh.distributed.testing import run_ranks
from trainmesh_bench.common import Setup, build, peak_rss, trainmesh_step
from trainmesh_bench.plan import step_peak

MIB = 2**20
PARTS = ("memory", "fit", "overlap", "torch")
FIT_UNIT = 16  # the measured search's resolution: multiples of 2·cp·FIT_UNIT tokens
REPEATS = 5  # timed repetitions of every measurement; medians with min-max are quoted
FIT_STEPS = 3  # timed steps at the longest sequence (the longest steps of the bench)


def _spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """``median (min-max)``."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


# --- memory: activation bytes, peak RSS and cp bytes per rank -------------------------------------------

def _impls(cp: int) -> tuple[str, ...]:
    return ("ring", "a2a") if cp > 1 else ("ring",)


def memory_rank(seq_len: int, global_batch: int, cp: int, impl: str, mesh: Mesh) -> dict[str, int]:
    """On every rank: one training step of ``small`` at ``seq_len`` tokens, as ``trainmesh train`` takes its
    first: the activation bytes its first micro-batch saved, the peak RSS during the step (the process's
    high-water mark reset first, :func:`trainmesh_bench.common.peak_rss`) and the bytes counted on ``cp``."""
    bench = build(_small(seq_len, cp, global_batch, impl), mesh)
    saved = SavedActivations(bench.model.module.parameters())
    before = bench.model.comm.totals().get(AXIS, 0)
    rss = peak_rss(trainmesh_step(bench, saved), 0, count=1)
    return {"activation_bytes": saved.bytes, "peak_rss": rss,
            "cp_bytes": int(bench.model.comm.totals().get(AXIS, 0) - before)}


def format_memory(seq_len: int, global_batch: int, got: dict[int, dict[str, dict[str, int]]]) -> str:
    """The ``memory`` table from rank 0's :func:`memory_rank` of each cp degree and implementation."""
    lines = [f"small, {global_batch} sequences of {seq_len} tokens, fp32, one step; per rank (rank 0):",
             f"{'layout':<12}{'act MiB':>10}{'plan MiB':>10}{'vs cp1':>8}{'peak RSS MiB':>14}"
             f"{'cp MiB':>10}{'formula MiB':>13}"]
    base = None
    for cp, impls in got.items():
        for impl, record in impls.items():
            setup = _small(seq_len, cp, global_batch, impl)
            predicted = micro_batch_activation_bytes(setup.workload, setup.layout)
            measured = record["activation_bytes"]
            base = base or measured
            formula = sum(cp_bytes_per_micro(setup.workload, setup.layout).values())
            lines.append(f"{f'cp{cp} {impl}':<12}{measured / MIB:>10.1f}{predicted / MIB:>10.1f}"
                         f"{measured / base:>8.2f}{record['peak_rss'] / MIB:>14.0f}"
                         f"{record['cp_bytes'] / MIB:>10.1f}{formula / MIB:>13.1f}")
    return "\n".join(lines)


# --- fit: the longest sequence under a memory cap -----------------------------------------------------

def largest_fitting(fits: Callable[[int], bool], unit: int, guess: int) -> int:
    """The largest multiple of ``unit`` for which ``fits`` (monotone: true up to some length, false after)
    holds, 0 if none: from ``guess``, gallop outwards (from 1/16 of it, doubling) until the answer is
    bracketed, then bisect."""
    lo, hi = 0, None  # lo fits (0 trivially), hi does not; both in units
    n, step = max(1, guess // unit), max(1, guess // unit // 16)
    while hi is None or hi - lo > 1:
        if fits(n * unit):
            lo = n
        else:
            hi = n
        if hi is None:
            n, step = n + step, 2 * step
        elif lo == 0 and n > 1 and n - step > 0:
            n, step = n - step, 2 * step
        else:
            n = (lo + hi) // 2
    return lo * unit


def _small(seq_len: int, cp: int, global_batch: int = 1, impl: str = "ring") -> Setup:
    """One step of ``small`` at ``seq_len`` tokens, in fp32 over ``cp`` ranks."""
    model = dataclasses.replace(preset("small"), seq_len=seq_len)
    return Setup("small", Layout(cp=cp, cp_impl=impl), global_batch, model, steps=1, warmup_steps=1)


def planned_peak(seq_len: int, cp: int) -> int:
    """The planner's memory per rank of one ``small`` step at ``seq_len`` tokens over ``cp`` ranks (ring)."""
    setup = _small(seq_len, cp)
    return memory_per_rank(setup.workload, setup.layout).total


def longest_fitting(cap: int, cp: int) -> int:
    """The planner's longest sequence (a multiple of 2·cp) whose step fits ``cap`` bytes per rank at ``cp``."""
    return largest_fitting(lambda seq: planned_peak(seq, cp) <= cap, 2 * cp, 1024)


def _sync() -> None:
    """Line the ranks up (one process: nothing to do), so a timed span starts and ends together."""
    if dist.is_initialized():
        dist.barrier()


def _measured_peak(seq_len: int, cp: int, mesh: Mesh) -> int:
    """The most tensor memory (model state + saved activations + logits) any rank held at once in one real
    step of ``small`` at ``seq_len`` tokens, after a first step has allocated the gradients and the
    optimizer's state: every rank gets the same answer."""
    bench = build(_small(seq_len, cp), mesh)
    trainmesh_step(bench)(0)
    peak = step_peak(bench, 1, steps=1).total
    del bench
    gc.collect()
    return int(log_all_reduce(torch.tensor([peak], dtype=torch.float64), reduce_op=dist.ReduceOp.MAX).item())


def _tokens_per_s(seq_len: int, cp: int, mesh: Mesh) -> list[float]:
    """tokens/s of each of :data:`FIT_STEPS` steps of ``small`` at ``seq_len`` tokens, after one warm-up step."""
    step = trainmesh_step(build(_small(seq_len, cp), mesh))
    step(0)
    rates = []
    for i in range(1, FIT_STEPS + 1):
        _sync()
        t0 = time.perf_counter()
        step(i)
        _sync()
        rates.append(seq_len / (time.perf_counter() - t0))
    return rates


def fit_rank(cp: int, cap: int, mesh: Mesh) -> dict:
    """On every rank of a cp job: the measured longest sequence under ``cap`` and tokens/s there."""
    probes: dict[int, int] = {}

    def fits(seq_len: int) -> bool:
        probes[seq_len] = _measured_peak(seq_len, cp, mesh)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"cp{cp}: {seq_len} tokens hold {probes[seq_len] / MIB:.1f} MiB", file=sys.stderr, flush=True)
        return probes[seq_len] <= cap

    longest = largest_fitting(fits, 2 * cp * FIT_UNIT, longest_fitting(cap, cp))
    return {"longest": longest, "probes": probes, "tokens_per_s": _tokens_per_s(longest, cp, mesh)}


def format_fit(cap: int, got: dict[int, dict]) -> str:
    """The ``fit`` table from rank 0's :func:`fit_rank` of each cp degree."""
    lines = [f"longest sequence whose step fits {cap / MIB:.0f} MiB per rank (model state + activations + "
             f"logits), ring, global batch 1:",
             f"{'cp':<4}{'planner':>9}{'measured':>10}{'(resolution)':>14}{'probes':>8}   tokens/s at that length "
             f"(median, min-max of {FIT_STEPS} steps)"]
    for cp, fit in got.items():
        lines.append(f"{cp:<4}{longest_fitting(cap, cp):>9,}{fit['longest']:>10,}{2 * cp * FIT_UNIT:>14}"
                     f"{len(fit['probes']):>8}   {_spread(fit['tokens_per_s'])}")
    return "\n".join(lines)


# --- overlap: the ring's timeline -------------------------------------------------------------------

def _attention_inputs(seq_len: int, cp: int, seed: int) -> list[torch.Tensor]:
    """q, k, v at ``small``'s attention shape (8 heads of 32) for ``seq_len / cp`` tokens."""
    shape = spec_of("small").shape(preset("small"))
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, shape.n_heads, seq_len // cp, shape.d_model // shape.n_heads, generator=gen,
                        requires_grad=True) for _ in range(3)]


def _transfer_seconds(comm: Comm, kv: torch.Tensor) -> float:
    """One ring message of ``kv``'s size to the next cp rank and from the previous, with nothing else
    running (all ranks start together)."""
    mesh = comm.mesh
    cp, r = mesh.size(AXIS), mesh.rank(AXIS)
    nxt, prev = mesh.global_rank(cp=(r + 1) % cp), mesh.global_rank(cp=(r - 1) % cp)
    incoming = torch.empty_like(kv)
    dist.barrier()
    t0 = time.perf_counter()
    for w in comm.send_recv([(kv, nxt)], [(incoming, prev)], axis=AXIS, op="calibrate"):
        w.wait()
    return time.perf_counter() - t0


def _ring_parts(cp: int) -> dict[str, tuple[str, Callable[[int], bool], int]]:
    """The timeline's parts: (pass, which steps, how many K/V-sized messages they wait on). Backward's ring
    steps receive K/V and the dK/dV of the step before; its last message, the dK/dV of the last step,
    arrives home after every block is done, with no compute left to hide it."""
    return {"forward": ("forward", lambda step: True, cp - 1),
            "backward": ("backward", lambda step: step < cp, 2 * (cp - 1)),
            "bwd home": ("backward", lambda step: step == cp, 1)}


def overlap_rank(seq_len: int, cp: int, mesh: Mesh) -> dict[str, dict[str, list[float]]]:
    """On every rank, per part of :func:`_ring_parts` and repetition: the ring's compute, its exposed wait
    and the transfer time of the messages it waited on."""
    comm = Comm(mesh)
    q, k, v = _attention_inputs(seq_len, cp, dist.get_rank())
    grad = torch.randn_like(q)
    parts = _ring_parts(cp)
    out = {part: {"compute": [], "wait": [], "transfer": []} for part in parts}
    for rep in range(REPEATS + 1):
        timeline = RingTimeline()
        message = _transfer_seconds(comm, torch.stack([k, v]).detach())
        dist.barrier()
        attention = ring_attention(q, k, v, comm, timeline=timeline)
        dist.barrier()  # backward starts together: a rank's wait for a late peer's forward is not transfer
        attention.backward(grad)
        if rep == 0:
            continue  # warm-up
        for part, (phase, steps, messages) in parts.items():
            for kind in ("compute", "wait"):
                out[part][kind].append(sum(s for p, step, k, s in timeline.events
                                           if p == phase and k == kind and steps(step)))
            out[part]["transfer"].append(messages * message)
    return out


def format_overlap(seq_len: int, got: dict[int, list[dict]]) -> str:
    """The ``overlap`` table from every rank's :func:`overlap_rank` of each cp degree above 1."""
    lines = [f"ring timeline, small's attention (8 heads of 32) at {seq_len} tokens, sums over the ranks, "
             f"median (min-max) of {REPEATS}; hidden = 1 - exposed wait / transfer (0 where the wait exceeds "
             f"the transfer: a peer still computing):",
             f"{'cp':<4}{'part':<10}{'compute s':>22}{'exposed wait s':>24}{'transfer s':>24}{'hidden':>20}"]
    for cp, ranks in got.items():
        parts = {part: {key: [sum(r[part][key][i] for r in ranks) for i in range(REPEATS)]
                        for key in ("compute", "wait", "transfer")} for part in _ring_parts(cp)}
        parts["all"] = {key: [sum(p[key][i] for p in parts.values()) for i in range(REPEATS)]
                        for key in ("compute", "wait", "transfer")}
        for part, got in parts.items():
            hidden = [max(0.0, 1 - w / t) for w, t in zip(got["wait"], got["transfer"])]
            lines.append(f"{cp:<4}{part:<10}{_spread(got['compute'], '{:.3f}'):>22}"
                         f"{_spread(got['wait'], '{:.4f}'):>24}{_spread(got['transfer'], '{:.4f}'):>24}"
                         f"{_spread(hidden, '{:.2f}'):>20}")
    return "\n".join(lines)


# --- torch: torch's own context_parallel ------------------------------------------------------------

def _timed_attention(attend: Callable[[], torch.Tensor]) -> list[float]:
    """Seconds of each of :data:`REPEATS` forward + backward passes of ``attend``, after one warm-up."""
    times = []
    for rep in range(REPEATS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        attend().sum().backward()
        dist.barrier()
        if rep:
            times.append(time.perf_counter() - t0)
    return times


def torch_cp_rank(seq_len: int, mesh: Mesh) -> dict:
    """On two ranks: seconds per forward + backward of causal attention over ``seq_len`` tokens through
    trainmesh's ring and through torch's ``context_parallel`` (or the error torch raised)."""
    comm = Comm(mesh)
    q, k, v = _attention_inputs(seq_len, 2, dist.get_rank())
    ours = _timed_attention(lambda: ring_attention(q, k, v, comm))
    whole = _attention_inputs(seq_len, 1, seed=2)  # the same whole sequence on both ranks
    try:
        with context_parallel(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)),
                              buffers=[t.detach() for t in whole], buffer_seq_dims=[2, 2, 2]):
            theirs = _timed_attention(lambda: F.scaled_dot_product_attention(*whole, is_causal=True))
    except Exception as e:  # what torch raises where it cannot run is the finding
        return {"ours": ours, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    return {"ours": ours, "theirs": theirs}


def format_torch(seq_len: int, got: dict) -> str:
    """The ``torch`` lines from rank 0's :func:`torch_cp_rank`."""
    ours = [seq_len / s for s in got["ours"]]
    lines = [f"causal attention over {seq_len} tokens at cp 2, forward + backward, tokens/s (median, min-max of "
             f"{REPEATS}):", f"  trainmesh ring: {_spread(ours)}"]
    if "error" in got:
        lines.append(f"  torch context_parallel {torch.__version__} on CPU/Gloo: does not run: {got['error']}")
        lines.append("  (compared instead: each cp at its own longest sequence under the same memory, `fit` above)")
    else:
        lines.append(f"  torch context_parallel: {_spread([seq_len / s for s in got['theirs']])}")
    return "\n".join(lines)


def cp_rank(cp: int, parts: tuple[str, ...], seq_len: int, global_batch: int, cap: int, impl: str = "ring") -> dict:
    """On every rank of one job of ``cp`` ranks: each of ``parts`` that measures at this degree, one after
    another in the same warm processes (one start-up, one data load per degree). ``memory`` measures
    ``impl`` only, first, so that its peak RSS is a fresh process's, as each layout's own ``trainmesh train``
    would see it."""
    mesh = api.init_mesh(cp=cp)
    out: dict = {}
    if "memory" in parts:
        out["memory"] = memory_rank(seq_len, global_batch, cp, impl, mesh)
        gc.collect()
    if "fit" in parts:
        out["fit"] = fit_rank(cp, cap, mesh)
    if "overlap" in parts and cp > 1:
        out["overlap"] = overlap_rank(seq_len, cp, mesh)
    if "torch" in parts and cp == 2:
        out["torch"] = torch_cp_rank(seq_len, mesh)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence of `memory`, `overlap` and `torch`")
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cap-mib", type=int, default=128, help="per-rank memory cap of `fit`")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per multi-rank run")
    args = parser.parse_args(argv)
    parts, cap = tuple(args.parts), args.cap_mib * MIB
    degrees = sorted(set(args.cp) | ({2} if "torch" in parts else set()))
    ranks = {cp: run_ranks(cp_rank, cp, cp, parts, args.seq_len, args.global_batch, cap, timeout=args.timeout)
             for cp in degrees}
    chosen = [cp for cp in degrees if cp in args.cp]
    memory = {cp: {"ring": ranks[cp][0].get("memory")} for cp in chosen}
    for cp in chosen if "memory" in parts else []:
        for impl in _impls(cp)[1:]:
            memory[cp][impl] = run_ranks(cp_rank, cp, cp, ("memory",), args.seq_len, args.global_batch, cap, impl,
                                         timeout=args.timeout)[0]["memory"]
    sections = {"memory": lambda: format_memory(args.seq_len, args.global_batch, memory),
                "fit": lambda: format_fit(cap, {cp: ranks[cp][0]["fit"] for cp in chosen}),
                "overlap": lambda: format_overlap(args.seq_len, {cp: [r["overlap"] for r in ranks[cp]]
                                                                 for cp in chosen if cp > 1}),
                "torch": lambda: format_torch(args.seq_len, ranks[2][0]["torch"])}
    for part in parts:
        print(sections[part](), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
