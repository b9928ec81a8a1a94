"""``make bench-cp``: context parallelism's memory and communication per rank at cp 1, 2 and 4, measured
against the planner's prediction and the byte formulas. Prints; asserts nothing.

Each run is a short ``trainmesh train`` of ``small`` at a long sequence (its learned position table sized
to it) on cp local ranks; rank metrics come from its ``metrics.jsonl``: the activation bytes the first
micro-batch saved (:class:`trainmesh.metrics.SavedActivations`), each rank's peak RSS, and the bytes
:class:`trainmesh.comm.Comm` counted on the ``cp`` axis, set against :func:`trainmesh.plan.cp_bytes_per_micro`; then the planner's longest sequence that fits
the activation bytes cp 1 measured, at each cp.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from trainmesh.config import Config
from trainmesh.plan import Layout, cp_bytes_per_micro, micro_batch_activation_bytes, workload_of

MIB = 2**20


def _run(cfg_args: list[str], out: Path) -> dict:
    """One short training run; its first step's metrics record."""
    subprocess.run([sys.executable, "-m", "trainmesh.cli", "train", *cfg_args, "--out", str(out), "--no-progress"],
                   check=True)
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def bench_cp(seq_len: int, global_batch: int, degrees: tuple[int, ...]) -> str:
    lines = [f"small, {global_batch} sequences of {seq_len} tokens, fp32, one step; per rank (rank 0):",
             f"{'layout':<12}{'act MiB':>10}{'plan MiB':>10}{'vs cp1':>8}{'peak RSS MiB':>14}"
             f"{'cp MiB':>10}{'formula MiB':>13}"]
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        for cp in degrees:
            for impl in ("ring", "a2a") if cp > 1 else ("ring",):
                args = ["--model", "small", "--seq-len", str(seq_len), "--global-batch", str(global_batch),
                        "--steps", "1", "--eval-batches", "1", "--nproc", str(cp), "--cp", str(cp),
                        "--cp-impl", impl]
                record = _run(args, Path(tmp, f"cp{cp}-{impl}"))
                cfg = Config(model="small", seq_len=seq_len, global_batch=global_batch, cp=cp, cp_impl=impl)
                layout = Layout(cp=cp, cp_impl=impl)
                predicted = micro_batch_activation_bytes(workload_of(cfg), layout)
                measured = record["activation_bytes"][0]
                base = base or measured
                counted = record["comm_bytes"].get("cp", 0)
                formula = sum(cp_bytes_per_micro(workload_of(cfg), layout).values())
                lines.append(f"{f'cp{cp} {impl}':<12}{measured / MIB:>10.1f}{predicted / MIB:>10.1f}"
                             f"{measured / base:>8.2f}{record['max_rss_bytes'][0] / MIB:>14.0f}"
                             f"{counted / MIB:>10.1f}{formula / MIB:>13.1f}")
    lines += ["", f"longest sequence whose activations fit cp1's at {seq_len} tokens ({base / MIB:.0f} MiB), "
                  f"planner: " + ", ".join(f"cp{cp} {longest_fitting(base, global_batch, cp):,}" for cp in degrees)]
    return "\n".join(lines)


def longest_fitting(cap: int, global_batch: int, cp: int) -> int:
    """The planner's longest sequence (a multiple of 2·cp·64 tokens) whose saved activations per rank fit
    ``cap`` bytes at ``cp`` (ring)."""
    step, seq = 2 * cp * 64, 0
    while True:
        cfg = Config(model="small", seq_len=seq + step, global_batch=global_batch, cp=cp)
        if micro_batch_activation_bytes(workload_of(cfg), Layout(cp=cp)) > cap:
            return seq
        seq += step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--global-batch", type=int, default=1)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    print(bench_cp(args.seq_len, args.global_batch, tuple(args.cp)))


if __name__ == "__main__":
    main()
