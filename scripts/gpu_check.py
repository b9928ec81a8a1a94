"""The GPU path measured in one go: the cases of ``docs/performance.md``, each a short ``trainmesh train`` run
with its own time limit, their tokens/s, MFU (against the dense bf16 and FP8 peaks), peak memory and loss
printed as one Markdown table, with issue #37's goals met or missed, and appended to that page with the
date, the GPU and the torch, torchao and triton versions.

The default cases (``gpt2-124m`` compiled in bf16, + CUDA graphs, + FP8; a ``llama-7b``-class model at the
most layers one GPU holds under ZeRO-3, in bf16 and FP8) are sized to finish in about 10 minutes on one GPU
(``scripts/gpu_check.sh`` runs the NCCL check first, then this); ``--cases all`` adds the earlier ones. On a
machine without a GPU, the command the script prints when it finds none runs every case through the same
path on CPU, which is how the script itself is checked where no GPU is lent.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    """One run of the check: a short ``key`` (for ``--cases``), what it shows, the flags beyond the common ones,
    which model it trains (``small``: ``--model``; ``larger``: ``--larger-model`` over every GPU; ``big``:
    ``--big-model`` resized to the most layers one GPU holds under ZeRO-3, on one GPU), whether it compiles,
    its precision, its time limit in seconds (compile and model build included), and the case whose loss at
    the last step its own must stay within 1 % of (FP8 against bf16)."""

    key: str
    name: str
    flags: tuple[str, ...] = ()
    model: str = "small"
    compile: bool = True
    precision: str = "bf16"
    timeout: float = 150.0
    baseline: str = ""


# bf16 weights with fp32 masters, SDPA (a fused flash-attention kernel on CUDA at bf16: cuDNN's on an H200
# with torch 2.11) and fused AdamW (trainmesh picks the fused kernel on CUDA) are common to every case, and
# torch.compile (each block and the loss) to all but the eager one, which shows what compiling buys; each
# case adds the form it measures. The default five are issue #37's (about 10 minutes on one GPU); ``--cases
# all`` adds the earlier ones.
BIG = ("--zero", "3", "--recompute", "full")
CASES = (
    Case("compiled", "bf16 + compile (SDPA, fused AdamW)", timeout=120),
    Case("graphs", "+ CUDA graphs", ("--cuda-graphs",), timeout=120),
    Case("fp8", "+ CUDA graphs + FP8 linears", ("--cuda-graphs",), precision="fp8", baseline="graphs"),
    Case("big-bf16", "7B-class, ZeRO-3, full recompute, bf16", BIG, model="big", timeout=210),
    Case("big-fp8", "7B-class, ZeRO-3, full recompute, FP8", BIG, model="big", precision="fp8", timeout=210,
         baseline="big-bf16"),
    Case("eager", "bf16 eager (SDPA, fused AdamW)", compile=False, timeout=90),
    Case("zero1", "+ ZeRO-1", ("--zero", "1"), timeout=120),
    Case("recompute", "+ full recompute", ("--recompute", "full"), timeout=120),
    Case("larger", "larger model, ZeRO-3 over every GPU", ("--zero", "3"), model="larger", timeout=180),
)
DEFAULT_CASES = ("compiled", "graphs", "fp8", "big-bf16", "big-fp8")
STATE_SHARE = 0.8
"""The share of a GPU's memory the big model's state may take; full recompute keeps activations in the rest."""


def selected(text: str) -> list[Case]:
    """The cases ``--cases`` names (comma-separated keys, or ``all``), in table order."""
    keys = [c.key for c in CASES] if text == "all" else text.split(",")
    unknown = [k for k in keys if k not in {c.key for c in CASES}]
    if unknown:
        raise SystemExit(f"gpu_check: unknown case {unknown[0]!r}; choose from {', '.join(c.key for c in CASES)} "
                         f"or all")
    return [c for c in CASES if c.key in keys]


def layers_one_gpu_holds(model: str, mem_bytes: int) -> int:
    """The most layers (at most the preset's) of ``model``'s shape whose ZeRO-3 model state on one GPU takes at
    most :data:`STATE_SHARE` of ``mem_bytes``: bf16 parameters and gradients, fp32 masters and Adam moments (16
    bytes per parameter [ZeRO, sec. 3.1]) and the fp32 copy of the gradients the step reads (4 more)."""
    from trainmesh.models import preset, spec_of
    from trainmesh.training.state_bytes import DTYPE_BYTES, precision_bytes

    spec, cfg = spec_of(model), preset(model)
    b = precision_bytes("bf16", "bf16")
    per_param = b.param + b.grad + b.optimizer + DTYPE_BYTES["fp32"]
    params = [spec.shape(dataclasses.replace(cfg, n_layers=n)).n_params() for n in (1, 2)]
    per_layer, rest = params[1] - params[0], 2 * params[0] - params[1]
    fit = int((STATE_SHARE * mem_bytes / per_param - rest) // per_layer)
    return max(1, min(cfg.n_layers, fit))


def micro_batch(case: Case, args: argparse.Namespace) -> int:
    return {"small": args.batch_per_gpu, "larger": args.larger_batch_per_gpu, "big": args.big_batch_per_gpu}[case.model]


def model_of(case: Case, args: argparse.Namespace) -> str:
    return {"small": args.model, "larger": args.larger_model, "big": args.big_model}[case.model]


def train_command(case: Case, args: argparse.Namespace, gpus: int, out: Path) -> list[str]:
    """The ``trainmesh train`` line of one case: data parallel over every GPU, one micro-batch per GPU; the big
    model's runs on one GPU through ``scripts/train_resized.py`` with ``args.big_layers`` layers."""
    ranks = 1 if case.model == "big" else gpus
    compile_flag = ["--compile"] if case.compile and not args.no_compile else []
    graphs = [f for f in case.flags if f != "--cuda-graphs" or compile_flag]
    entry = ([str(ROOT / "scripts" / "train_resized.py"), str(args.big_layers)] if case.model == "big"
             else ["-m", "trainmesh", "train"])
    return [sys.executable, *entry, "--nproc", str(ranks), "--dp", str(ranks),
            "--model", model_of(case, args), "--precision", case.precision, "--reduce-dtype", "bf16",
            "--device", args.device, *compile_flag, "--steps", str(args.steps),
            "--global-batch", str(micro_batch(case, args) * ranks), "--warmup-steps", str(min(5, args.steps - 1)),
            "--eval-batches", "1", "--out", str(out), "--no-progress", *graphs]


def run_case(case: Case, args: argparse.Namespace, gpus: int, work: Path) -> dict:
    """Runs one case within its time limit (``--timeout`` when given) and returns its row; a failed or
    timed-out run is a row that says so rather than an abort, so one out-of-memory case or one slow compile
    does not cost the figures of the others. The case's whole output goes to ``--logs`` when given, for the
    failures a one-line row cannot explain."""
    out = work / case.key
    cmd = train_command(case, args, gpus, out)
    limit = args.timeout or case.timeout
    print("$", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "error": f"no result within {limit:g} s"}
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        (Path(args.logs) / f"{case.key}.log").write_text(f"$ {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"case": case.name, "error": f"exit {done.returncode}: {tail[0]}"}
    return row(case, args, json.loads((out / "summary.json").read_text()),
               [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])


def row(case: Case, args: argparse.Namespace, s: dict, records: list[dict]) -> dict:
    """A case's row from its run's ``summary.json`` and per-step ``records``: the median step's tokens/s (the
    first step, which compiles, left out) and its MFU against the dense bf16 and FP8 peaks (the run's own
    ``mfu`` is against its precision's peak)."""
    steps = records[1:]
    median = statistics.median(r["tokens_per_s"] for r in steps) if steps else s["tokens_per_s"]
    mfu = None if s["mfu"] is None else s["mfu"] * median / s["tokens_per_s"]
    return {"case": case.name, "key": case.key, "model": s["model"], "micro_batch": micro_batch(case, args),
            "gpus": s["world_size"], "tokens_per_s": s["tokens_per_s"], "median_tokens_per_s": median,
            "mfu_bf16": None if mfu is None else mfu * peak(case.precision) / peak("bf16"),
            "mfu_fp8": None if mfu is None or not peak("fp8") else mfu * peak(case.precision) / peak("fp8"),
            "peak_gib": max(s["peak_device_bytes"]) / 2**30, "last_loss": records[-1]["loss"],
            "loss": f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}"}


def peak(precision: str, name: str | None = None) -> float:
    """This GPU's (or ``name``'s) dense peak FLOP/s at ``precision`` from trainmesh's table; 0 if unknown."""
    from trainmesh.distributed.hardware import device_peak

    name = name if name is not None else (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    row = device_peak(name)
    return row.at(precision) if row is not None else 0.0


def loss_gap(r: dict, rows: dict[str, dict]) -> float | None:
    """Relative difference of ``r``'s last-step loss from its baseline case's, if both ran."""
    base = rows.get(CASE_OF[r["key"]].baseline) if "key" in r else None
    if base is None or "error" in base or "error" in r:
        return None
    return (r["last_loss"] - base["last_loss"]) / base["last_loss"]


CASE_OF = {c.key: c for c in CASES}


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def table(rows: list[dict]) -> str:
    """The Markdown table of the cases: tokens/s over every step, the median step's tokens/s (which a slow
    recompile or evaluation pause does not move), that step's MFU against the GPU's dense bf16 and FP8 peaks
    ('n/a' where unknown), peak memory, the loss, and an FP8 case's last-step loss against its bf16 case's."""
    by_key = {r["key"]: r for r in rows if "key" in r}
    lines = ["| case | model | GPUs | micro-batch / GPU | tokens/s | median step tokens/s | MFU (bf16 peak) | "
             "MFU (FP8 peak) | peak device memory / GPU | loss | last loss vs baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | failed: {r['error']} | | | | | | |")
            continue
        gap = loss_gap(r, by_key)
        lines.append(f"| {r['case']} | {r['model']} | {r['gpus']} | {r['micro_batch']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['median_tokens_per_s']:,.0f} | {_percent(r['mfu_bf16'])} | {_percent(r['mfu_fp8'])} | "
                     f"{r['peak_gib']:.2f} GiB | {r['loss']} | {'' if gap is None else f'{gap:+.2%}'} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> list[str]:
    """Issue #37's goals, each met, missed or not measured: >= 50 % MFU for the compiled small model in bf16
    (with or without CUDA graphs), FP8 >= 1.3x bf16's tokens/s on the 7B-class case, and FP8's last-step loss
    within 1 % of bf16's."""
    ok = {r["key"]: r for r in rows if "key" in r and "error" not in r}
    lines = []
    bf16 = [ok[k]["mfu_bf16"] for k in ("compiled", "graphs") if k in ok and ok[k]["mfu_bf16"] is not None]
    lines.append("- MFU >= 50 % (small model, bf16, compiled): " +
                 (f"{'met' if max(bf16) >= 0.5 else 'missed'} ({max(bf16):.1%})" if bf16 else "not measured"))
    if "big-bf16" in ok and "big-fp8" in ok:
        speedup = ok["big-fp8"]["median_tokens_per_s"] / ok["big-bf16"]["median_tokens_per_s"]
        lines.append(f"- FP8 >= 1.3x bf16 tokens/s (7B-class): {'met' if speedup >= 1.3 else 'missed'} "
                     f"({speedup:.2f}x)")
    else:
        lines.append("- FP8 >= 1.3x bf16 tokens/s (7B-class): not measured")
    for key in ("fp8", "big-fp8"):
        gap = loss_gap(ok[key], ok) if key in ok else None
        lines.append(f"- FP8 loss within 1 % of bf16 ({CASE_OF[key].name}): " +
                     ("not measured" if gap is None else f"{'met' if abs(gap) <= 0.01 else 'missed'} ({gap:+.2%})"))
    return lines


def versions() -> str:
    """torch, torchao and triton versions, and the trainmesh commit, for the table's header."""
    import importlib.metadata

    found = [f"torch {torch.__version__}"]
    for package in ("torchao", "triton"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"no {package}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return ", ".join(found + ([f"trainmesh {commit.stdout.strip()}"] if commit.returncode == 0 else []))


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU (script check, not a measurement)"


def report(rows: list[dict], device: str, gpus: int, steps: int, big_layers: int) -> str:
    """The dated section appended to docs/performance.md: header, table and goals."""
    header = (f"### {datetime.date.today().isoformat()}: {device_name(device)} x{gpus}, {versions()}, {steps} "
              f"steps, 7B-class model at {big_layers} layers")
    return f"{header}\n\n{table(rows)}\n\n" + "\n".join(goals(rows)) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help=f"comma-separated cases, or all ({', '.join(c.key for c in CASES)}; default: "
                        f"{','.join(DEFAULT_CASES)})")
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--larger-model", default="gpt2-1.5b")
    p.add_argument("--big-model", default="llama-7b", help="the 7B-class model, resized to --big-layers")
    p.add_argument("--big-layers", type=int, default=0,
                   help="layers of --big-model (0: the most whose ZeRO-3 state fits in 3/4 of the GPU)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-per-gpu", type=int, default=64,
                   help="micro-batch per GPU of --model's cases (64 x 1024 tokens, llm.c's for GPT-2 124M)")
    p.add_argument("--larger-batch-per-gpu", type=int, default=16, help="micro-batch per GPU of --larger-model")
    p.add_argument("--big-batch-per-gpu", type=int, default=4, help="micro-batch of --big-model")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds every case may take, compile included (default: each case's own limit)")
    p.add_argument("--no-compile", action="store_true",
                   help="run every case eagerly: for checking the script on CPU, where compiling takes minutes")
    p.add_argument("--logs", default="", help="folder for each case's whole output")
    p.add_argument("--write", default=str(ROOT / "docs" / "performance.md"),
                   help="page the dated table is appended to")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = selected(args.cases)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device; install a CUDA build of torch, or check the script "
                 "itself with --device cpu --model tiny --larger-model tiny --big-model llama-tiny --big-layers 2 "
                 "--batch-per-gpu 2 --larger-batch-per-gpu 2 --big-batch-per-gpu 2 --steps 3 --no-compile "
                 "--no-write --cases all")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 1
    if not args.big_layers:
        if args.device != "cuda":
            sys.exit("gpu_check: give --big-layers on CPU (no GPU memory to size the 7B-class model by)")
        args.big_layers = layers_one_gpu_holds(args.big_model, torch.cuda.get_device_properties(0).total_memory)
    with tempfile.TemporaryDirectory() as work:
        rows = []
        for case in cases:
            rows.append(run_case(case, args, gpus, Path(work)))
            print(table(rows).splitlines()[-1], flush=True)
    text = report(rows, args.device, gpus, args.steps, args.big_layers)
    print(text)
    if not args.no_write:
        with open(args.write, "a") as f:
            f.write(f"\n{text}")
        print(f"appended to {args.write}")


if __name__ == "__main__":
    main()
