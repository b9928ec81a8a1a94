"""``trainmesh bench all``: every form beside its torch peer, one launch each, gathered into one table.

Each form is its own ``trainmesh bench FORM`` launch (so forms never disturb each other's figures) handing
back :class:`trainmesh_bench.common.Result` rows as JSON; the table goes to the terminal, ``results.json``
and ``results.md``."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

FORMS = {
    "dp": ["--dp", "{n}", "--microbatches", "2"],
    "zero": ["--dp", "{n}"],
    "tp": ["--tp", "{n}"],
    "pp": ["--pp", "{n}", "--microbatches", "8"],
}
"""Each form's layout over the ``--nproc`` ranks."""


def machine() -> str:
    """The CPU (or GPU) model, its core count, and torch's version: what a reader needs to compare."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu} ({os.cpu_count()} cores){gpu}, torch {torch.__version__}"


def run_all(nproc: int, model: str, global_batch: int, pairs: int, out: str) -> int:
    """Run every form's bench; print and write the table; 1 if any form failed (the others still run)."""
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for form, layout in FORMS.items():
            results = Path(tmp, f"{form}.json")
            argv = [sys.executable, "-m", "trainmesh", "bench", form, "--nproc", str(nproc),
                    *(a.format(n=nproc) for a in layout), "--model", model, "--global-batch", str(global_batch),
                    "--pairs", str(pairs), "--results", str(results)]
            print(f"bench all: {' '.join(argv[3:-2])}", flush=True)
            if subprocess.run(argv).returncode != 0 or not results.exists():
                failed.append(form)
                continue
            rows += json.loads(results.read_text())
    header = (f"trainmesh vs torch peers: model {model}, {nproc} ranks, global batch {global_batch}, {pairs} "
              f"timed pairs of steps; {machine()}; {datetime.date.today().isoformat()}")
    table = markdown_table(rows)
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, "results.json").write_text(json.dumps({"header": header, "rows": rows, "failed": failed}, indent=1))
    Path(out, "results.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{header}\n\n{table}\n\nwritten to {Path(out, 'results.md')} and results.json")
    if failed:
        print(f"bench all: {', '.join(failed)} failed; their output is above", file=sys.stderr)
    return 1 if failed else 0


def _mib(values: list[int]) -> str:
    return f"{max(values) / 2**20:.0f}" if values else "-"


def markdown_table(rows: list[dict]) -> str:
    """One row per form: the median trainmesh/peer tokens/s ratio over the timed pairs with its min and max,
    trainmesh's median tokens/s, and the largest per-rank peak RSS of each side."""
    lines = ["| form | trainmesh | peer | ratio median (min-max) | trainmesh tokens/s | peak RSS MiB (ours / peer) | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = (f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})" if "ratio_median" in r
                 else "no peer run")
        lines.append(f"| {r['form']} | {r['ours']} | {r['peer']} | {ratio} | {r['tokens_per_s_median']:,.0f} | "
                     f"{_mib(r['peak_rss'])} / {_mib(r['peer_peak_rss'])} | {r['note']} |")
    return "\n".join(lines)
