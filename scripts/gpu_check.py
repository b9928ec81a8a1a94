"""The GPU path measured in one go: the cases of ``docs/performance.md``, each a short ``trainmesh train`` run,
their tokens/s, MFU and peak memory printed as one Markdown table and appended to that page with the date,
the GPU and the torch version.

Sized to finish in about 5 minutes on one GPU (``scripts/gpu_check.sh`` runs the NCCL check first, then
this). On a machine without a GPU, ``--device cpu --model tiny --larger-model tiny --steps 3 --no-write``
runs every case through the same path, which is how the script itself is checked where no GPU is lent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    """One run of the check: what it shows, the flags beyond the common ones, the model it trains, and
    whether it compiles."""

    name: str
    flags: tuple[str, ...]
    larger: bool = False
    compile: bool = True


# bf16 weights with fp32 masters, SDPA (a fused flash-attention kernel on CUDA at bf16: cuDNN's on an H200
# with torch 2.11) and fused AdamW (trainmesh picks the fused kernel on CUDA) are common to every case, and
# torch.compile (each block and the loss) to all but the first, which shows what compiling buys; each case
# adds the form it measures.
CASES = (
    Case("bf16 eager (SDPA, fused AdamW)", (), compile=False),
    Case("bf16 + compile (SDPA, fused AdamW)", ()),
    Case("+ ZeRO-1", ("--zero", "1")),
    Case("+ full recompute", ("--recompute", "full")),
    Case("larger model, ZeRO-3 over every GPU", ("--zero", "3"), larger=True),
)


def micro_batch(case: Case, args: argparse.Namespace) -> int:
    return args.larger_batch_per_gpu if case.larger else args.batch_per_gpu


def train_command(case: Case, args: argparse.Namespace, gpus: int, out: Path) -> list[str]:
    """The ``trainmesh train`` line of one case: data parallel over every GPU, one micro-batch per GPU."""
    model = args.larger_model if case.larger else args.model
    compile_flag = ["--compile"] if case.compile else []
    return [sys.executable, "-m", "trainmesh", "train", "--nproc", str(gpus), "--dp", str(gpus),
            "--model", model, "--precision", "bf16", "--reduce-dtype", "bf16", "--device", args.device,
            *compile_flag, "--steps", str(args.steps), "--global-batch", str(micro_batch(case, args) * gpus),
            "--warmup-steps", str(min(5, args.steps - 1)), "--eval-batches", "1", "--out", str(out),
            "--no-progress", *case.flags]


def run_case(case: Case, args: argparse.Namespace, gpus: int, work: Path) -> dict:
    """Runs one case and returns its row; a failed or timed-out run is a row that says so rather than an
    abort, so one out-of-memory case or one slow compile does not cost the figures of the others. The
    case's whole output goes to ``--logs`` when given, for the failures a one-line row cannot explain."""
    index = CASES.index(case)
    out = work / f"case{index}"
    cmd = train_command(case, args, gpus, out)
    print("$", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "error": f"no result within {args.timeout} s"}
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        (Path(args.logs) / f"case{index}.log").write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"case": case.name, "error": f"exit {done.returncode}: {tail[0]}"}
    s = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    median = statistics.median(r["tokens_per_s"] for r in steps) if steps else s["tokens_per_s"]
    return {"case": case.name, "model": args.larger_model if case.larger else args.model,
            "micro_batch": micro_batch(case, args),
            "tokens_per_s": s["tokens_per_s"], "median_tokens_per_s": median,
            "mfu": None if s["mfu"] is None else s["mfu"] * median / s["tokens_per_s"],
            "peak_gib": max(s["peak_device_bytes"]) / 2**30, "rss_gib": max(s["max_rss_bytes"]) / 2**30,
            "loss": f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}"}


def table(rows: list[dict], gpus: int) -> str:
    """The Markdown table of the cases: tokens/s over every step after the first (the one that compiles),
    the median step's tokens/s, which a slow recompile or evaluation pause does not move, and the MFU of that
    median step against the GPU's dense bf16 peak ('n/a' where unknown)."""
    lines = ["| case | model | GPUs | micro-batch / GPU | tokens/s | median step tokens/s | MFU | "
             "peak device memory / GPU | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | {gpus} | | failed: {r['error']} | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['case']} | {r['model']} | {gpus} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['median_tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['peak_gib']:.2f} GiB | {r['loss']} |")
    return "\n".join(lines)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU (script check, not a measurement)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--larger-model", default="gpt2-1.5b")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-per-gpu", type=int, default=64,
                   help="micro-batch per GPU of --model's cases (64 x 1024 tokens, llm.c's for GPT-2 124M)")
    p.add_argument("--larger-batch-per-gpu", type=int, default=16, help="micro-batch per GPU of --larger-model")
    p.add_argument("--timeout", type=float, default=300, help="seconds one case may take, compile included")
    p.add_argument("--logs", default="", help="folder for each case's whole output")
    p.add_argument("--write", default=str(ROOT / "docs" / "performance.md"),
                   help="page the dated table is appended to")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; install a CUDA build of torch, or check the script "
                 "itself with --device cpu --model tiny --larger-model tiny --steps 3 --no-write")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 1
    with tempfile.TemporaryDirectory() as work:
        rows = []
        for case in CASES:
            rows.append(run_case(case, args, gpus, Path(work)))
            print(table(rows[-1:], gpus).splitlines()[-1], flush=True)
    header = (f"### {datetime.date.today().isoformat()}: {device_name(args.device)} x{gpus}, "
              f"torch {torch.__version__}, {args.steps} steps")
    text = f"{header}\n\n{table(rows, gpus)}\n"
    print(text)
    if not args.no_write:
        with open(args.write, "a") as f:
            f.write(f"\n{text}")
        print(f"appended to {args.write}")


if __name__ == "__main__":
    main()
