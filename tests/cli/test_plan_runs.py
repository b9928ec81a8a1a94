"""The command ``trainmesh plan`` prints starts the run it planned: pasted as printed (``trainmesh`` being
``python -m trainmesh``), with only the run's length and directory added, it trains with that layout."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from trainmesh.app.planning import add_plan_arguments, plan_from_args

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
LAYOUT = ("dp", "tp", "pp", "cp", "zero", "microbatches", "recompute", "precision", "global_batch", "stage_layers")


def _trainmesh(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "trainmesh", *words], capture_output=True, text=True, env=ENV,
                         cwd=cwd, timeout=240)
    assert out.returncode == 0, f"trainmesh {' '.join(words)} failed:\n{out.stderr[-3000:]}"
    return out


def test_the_printed_single_node_command_trains_with_the_planned_layout(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--gpus", "2", "--gpu", "cpu", "--global-batch", "4"])
    printed = plan_from_args(args).splitlines()[-1]
    words = shlex.split(printed)
    assert words[:2] == ["trainmesh", "train"] and words[words.index("--nproc") + 1] == "2"
    _trainmesh([*words[1:], "--steps", "2", "--out", "run", "--no-tensorboard", "--device", "cpu"], tmp_path)
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    planned = {words[i].removeprefix("--").replace("-", "_"): words[i + 1] for i in range(2, len(words) - 1)
               if words[i].startswith("--") and not words[i + 1].startswith("--")}
    assert ran["model"] == "tiny" and ran["nproc"] == 2
    assert {k: str(ran[k]) for k in LAYOUT if k in planned} == {k: planned[k] for k in LAYOUT if k in planned}
    assert ran["steps"] == 2
