"""``--profile-steps``: a torch.profiler trace per rank and a summary of where the time went."""

import json
import os
import subprocess
import sys

import pytest

from trainmesh.tracking.profiling import busy_us


def test_busy_time_counts_overlapping_kernels_once():
    assert busy_us([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (5.5, 5.8)]) == 4.0
    assert busy_us([]) == 0.0


@pytest.mark.slow  # ~12 s: a two-rank profiled run
def test_profiled_run_writes_a_trace_per_rank_and_prints_the_top_ops(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--nproc", "2", "--dp", "2", "--model",
                             "tiny", "--steps", "3", "--profile-steps", "2", "--out", str(out), "--no-progress"],
                            capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        names = {e.get("name") for e in json.loads((out / "profile" / f"rank{rank}.json").read_text())["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names
    assert "Self CPU" in result.stdout and "aten::" in result.stdout
    assert result.stdout.index("Self CPU") < result.stdout.index("done:")
