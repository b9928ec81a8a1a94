"""``make bench-multinode``: ZeRO-3 over all ranks vs hybrid sharding (HSDP) on the namespace test bed.

Two nodes of two ranks joined by a rate-limited link run each layout; per step it prints the bytes the
kernel counted crossing the node link beside the formulas and the planner's prediction (:func:`planned`),
and the step time. Prints; asserts nothing. Formulas: docs/performance.md."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = {"zero3": 1, "hsdp2x2": 2}  # name -> dp_replicate
NODES, PER_NODE = 2, 2
PORT = 29651


def crossing_formula(params: int, nbytes: int, replicas: int, world: int = NODES * PER_NODE,
                     per_node: int = PER_NODE) -> int:
    """Bytes per step that cross between nodes (module docstring): ZeRO-3 over all ranks, or HSDP."""
    if replicas == 1:
        return 3 * (world - per_node) * params * nbytes
    return 2 * (replicas - 1) * params * nbytes


def planned(replicas: int, model: str, global_batch: int, rate_mbit: float) -> tuple[float, float]:
    """The planner's (bytes crossing the node link per step, step seconds) for ZeRO-3 over the bed's ranks in
    ``replicas`` hybrid groups: :func:`trainmesh.plan.dp_traffic.dp_traffic` on a ``cpu`` cluster of
    :data:`NODES` x :data:`PER_NODE` ranks whose inter-node bandwidth per rank is the link's rate over the
    ranks sharing it, and :func:`trainmesh.plan.step_time` with the ranks sharing this host's cores."""
    from trainmesh.plan import Layout, Workload, make_cluster, model_shape, step_time
    from trainmesh.plan.dp_traffic import dp_traffic

    world = NODES * PER_NODE
    cluster = make_cluster("cpu", world, PER_NODE, inter_gbps=rate_mbit / 8e3 / PER_NODE)
    cluster = dataclasses.replace(cluster, ranks_per_core=max(1.0, world / (os.cpu_count() or 1)))
    shape = model_shape(model)
    work = Workload(shape, global_batch, shape.seq_len, "fp32")
    layout = Layout(dp=world, zero=3, dp_replicate=replicas)
    return world * dp_traffic(work, layout, cluster, 0).inter, step_time(work, layout, cluster).total


HEADER = (f"{'layout':<10} {'link MB/step':>13} {'formula MB':>11} {'counted/formula':>16} {'planned MB':>11} "
          f"{'step s':>8} {'planned s':>10}")


def report_row(name: str, measured: dict, planned_bytes: float, planned_s: float) -> str:
    """One layout's line: the counted bytes, the formula's, their ratio, the planner's bytes, the measured
    and the planned step time."""
    link, formula = measured["link_bytes_per_step"], measured["formula"]
    return (f"{name:<10} {link / 1e6:>13.2f} {formula / 1e6:>11.2f} {link / formula:>16.3f} "
            f"{planned_bytes / 1e6:>11.2f} {measured['step_s']:>8.2f} {planned_s:>10.2f}")


def _tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def rank_main(replicas: int, model: str, steps: int, global_batch: int, out: str) -> None:
    """One rank: build ``model`` under ZeRO-3 with ``replicas`` replica groups, take a warm-up step, then
    ``steps`` timed ones, counting this node's veth bytes around them; rank 0 writes the figures to ``out``."""
    import trainmesh as tm
    from trainmesh.models.gpt import GPT, PRESETS

    cfg = PRESETS[model]
    mesh = tm.init_mesh(dp=NODES * PER_NODE, dp_replicate=replicas)
    pm = tm.parallelize(GPT(cfg, seed=0), mesh, zero=3)
    opt = tm.optimizer(pm, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len), generator=gen) for _ in range(2)]
    tm.train_step(pm, opt, tuple(batch))
    dist.barrier()
    sent, times = -_tx_bytes(), []
    for _ in range(steps):
        start = time.perf_counter()
        tm.train_step(pm, opt, tuple(batch))
        times.append(time.perf_counter() - start)
    dist.barrier()
    sent += _tx_bytes()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    counted = torch.tensor([sent if local == 0 else 0], dtype=torch.float64)
    dist.all_reduce(counted)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in GPT(cfg, seed=0).parameters())
        Path(out).write_text(json.dumps({"link_bytes_per_step": counted.item() / steps,
                                         "formula": crossing_formula(params, 4, replicas),
                                         "step_s": statistics.median(times), "params": params}))


def run_layout(bed, replicas: int, args: argparse.Namespace, out: Path) -> dict:
    """Launch this file on both nodes for one layout; its figures."""
    argv = lambda k: [sys.executable, "-m", "trainmesh", "launch", "--nnodes", str(NODES), "--node-rank", str(k),
                      "--master-addr", bed.members[0].addr, "--master-port", str(PORT), "--nproc", str(PER_NODE),
                      __file__, "--rank", str(replicas), "--model", args.model, "--steps", str(args.steps),
                      "--global-batch", str(args.global_batch), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_HOST_TRANSPORT": "auto"}
    procs = [bed.start(k, argv(k), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(NODES)]
    errs = [p.communicate(timeout=1800)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"the {replicas}-replica run failed:\n" + "\n".join(e[-3000:] for e in errs))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)  # replicas, inside a rank
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        rank_main(args.rank, args.model, args.steps, args.global_batch, args.out)
        return 0
    from trainmesh.distributed.testbed import TestBed, missing_capability

    reason = missing_capability()
    if reason:
        print(f"bench-multinode: skipped: {reason}")
        return 0
    print(f"{NODES} nodes x {PER_NODE} ranks, link {args.rate_mbit:g} Mbit/s each way (tbf), model {args.model}, "
          f"global batch {args.global_batch}, fp32, {args.steps} timed steps after one warm-up, median step")
    print(HEADER)
    with tempfile.TemporaryDirectory() as tmp:
        for name, replicas in LAYOUTS.items():
            with TestBed(NODES, rate_mbit=args.rate_mbit) as bed:
                r = run_layout(bed, replicas, args, Path(tmp) / f"{name}.json")
            print(report_row(name, r, *planned(replicas, args.model, args.global_batch, args.rate_mbit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
