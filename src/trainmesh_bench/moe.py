"""``make bench-moe``: expert parallelism's all-to-all volume, speed and memory at ep 1, 2 and 4, and the
experts' grouped GEMM against a per-expert loop. Prints; asserts nothing.

Every ep runs ``moe-tiny`` on the same 4 dp ranks in fresh processes; the bytes sent off-rank are compared
with ``tokens x top-k x hidden x bytes x (ep-1)/ep`` per direction. Method: docs/performance.md."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from trainmesh.layout import Layout
from trainmesh.models import preset
from trainmesh.distributed.comm import Comm
from trainmesh.parallel.expert_parallel import EP_AXIS, expert_modules
from trainmesh.tracking.metrics import max_rss_bytes, storage_bytes
from trainmesh.models.moe import MATMULS
from trainmesh.distributed.testing import run_ranks
from trainmesh_bench.common import Setup, build, init_mesh, trainmesh_step

MIB = 2**20


def _median_range(values: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _token_bytes(comm: Comm) -> float:
    """The token bytes the dispatchers' all-to-alls have sent so far, their expert counts left out."""
    return sum(n for (axis, op), n in comm.bytes.items() if axis == EP_AXIS and op != "moe_counts")


def _ep_rank(cfg: Setup, steps: int) -> dict:
    """Runs on every rank: ``steps`` training steps (the first untimed); per-step sent bytes and times."""
    torch.set_num_threads(1)
    bench = build(cfg, init_mesh(cfg))
    model, train_step = bench.model, trainmesh_step(bench)
    sent, times = [], []
    for step in range(steps):
        before = _token_bytes(model.comm)
        t0 = time.perf_counter()
        train_step(step)
        times.append(time.perf_counter() - t0)
        sent.append(_token_bytes(model.comm) - before)
    return {"sent": sent[1:], "times": times[1:], "rss": max_rss_bytes(), "layers": len(expert_modules(model.module)),
            "state": storage_bytes(model.engine.state_tensors())}


def _routed(model: str) -> object:
    """``model``'s preset with the routing ``trainmesh train`` gives it by default (dropless, ``--moe-aux-coef
    0.01 --moe-z-coef 0.001``, no bias update), what this benchmark has always measured."""
    cfg = preset(model)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=0.0, aux_coef=0.01, z_coef=0.001,
                                                            bias_rate=0.0))


def bench_ep(model: str, world: int, degrees: tuple[int, ...], steps: int, global_batch: int) -> str:
    base = Setup(model, Layout(dp=world), global_batch, _routed(model))
    m = base.model_config
    tokens = global_batch // world * m.seq_len
    copy_bytes = m.d_model * 4
    lines = [f"{model}, dp={world}, {global_batch} sequences of {m.seq_len} tokens per step, fp32, "
             f"{m.moe.n_experts} experts top-{m.moe.top_k}; per rank, median (min-max) over {steps - 1} timed steps:",
             f"{'layout':<8}{'a2a KiB/step':>14}{'formula KiB':>13}{'per direction KiB':>19}"
             f"{'tokens/s':>24}{'model state KiB':>17}{'peak RSS MiB':>14}"]
    for ep in degrees:
        cfg = base.with_layout(ep=ep)
        results = run_ranks(_ep_rank, world, cfg, steps, timeout=600)
        layers = results[0]["layers"]
        per_direction = tokens * m.moe.top_k * copy_bytes
        formula = 4 * layers * per_direction * (ep - 1) / ep
        sent = [s for r in results for s in r["sent"]]
        tps = [global_batch * m.seq_len / t for t in results[0]["times"]]
        rss = [r["rss"] / MIB for r in results]
        lines.append(f"{f'ep{ep}':<8}{statistics.median(sent) / 1024:>14.1f}{formula / 1024:>13.1f}"
                     f"{per_direction / 1024:>19.1f}{_median_range(tps):>24}{results[0]['state'] / 1024:>17.0f}"
                     f"{f'{min(rss):.0f}-{max(rss):.0f}':>14}")
    lines.append("(a2a: bytes sent to other ranks, 4 transfers per MoE layer per step: dispatch and combine, "
                 "forward and backward; formula: 4 x layers x per-direction volume x (ep-1)/ep)")
    return "\n".join(lines)


def _time_matmul(impl: str, x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> float:
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    t0 = time.perf_counter()
    MATMULS[impl](xs, ws, counts).sum().backward()
    return time.perf_counter() - t0


def bench_grouped(copies: int, d: int, f: int, n_experts: int, rounds: int) -> str:
    """One batched GEMM over padded experts vs one GEMM per expert, same sorted tokens, forward+backward."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(n_experts, (copies,), generator=gen), minlength=n_experts).tolist()
    x, w = torch.randn(copies, d, generator=gen), torch.randn(n_experts, d, f, generator=gen)
    times: dict[str, list[float]] = {impl: [] for impl in MATMULS}
    for _ in range(rounds):
        for impl in MATMULS:
            times[impl].append(_time_matmul(impl, x, w, counts))
    ratio = [a / b for a, b in zip(times["loop"], times["padded"])]
    cells = ", ".join(f"{impl} {_median_range([t * 1e3 for t in ts], '{:.2f}')} ms" for impl, ts in times.items())
    return (f"{copies} copies, d={d} -> f={f}, {n_experts} experts (max {max(counts)} per expert): {cells}; "
            f"loop/padded {_median_range(ratio, '{:.2f}')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="moe-tiny")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    print(bench_ep(args.model, args.nproc, tuple(args.ep), args.steps, args.global_batch))
    print("\ngrouped GEMM (padded batched matmul) vs a per-expert loop, fp32, forward+backward, median (min-max):")
    for copies, d, f in ((512, 64, 64), (8192, 256, 512)):
        print(bench_grouped(copies, d, f, 8, args.rounds))


if __name__ == "__main__":
    main()
