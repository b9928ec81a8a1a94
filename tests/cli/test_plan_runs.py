"""The command ``trainmesh plan`` prints starts the run it planned: pasted as printed (``trainmesh`` being
``python -m trainmesh``), with only the run's length and directory added, it trains with that layout."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainmesh.app.planning import add_plan_arguments, plan_from_args
from trainmesh.distributed.testbed import TestBed, missing_capability

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
LAYOUT = ("dp", "tp", "pp", "cp", "zero", "microbatches", "recompute", "precision", "global_batch", "stage_layers")


def _trainmesh(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "trainmesh", *words], capture_output=True, text=True, env=ENV,
                         cwd=cwd, timeout=240)
    assert out.returncode == 0, f"trainmesh {' '.join(words)} failed:\n{out.stderr[-3000:]}"
    return out


def _printed(argv: list[str]) -> str:
    """The last line ``trainmesh plan`` prints: the command that starts the chosen run."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return plan_from_args(parser.parse_args(argv)).splitlines()[-1]


def test_the_printed_single_node_command_trains_with_the_planned_layout(tmp_path: Path) -> None:
    printed = _printed(["--model", "tiny", "--gpus", "2", "--gpu", "cpu", "--global-batch", "4"])
    words = shlex.split(printed)
    assert words[:2] == ["trainmesh", "train"] and words[words.index("--nproc") + 1] == "2"
    _trainmesh([*words[1:], "--steps", "2", "--out", "run", "--no-tensorboard", "--device", "cpu"], tmp_path)
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    planned = {words[i].removeprefix("--").replace("-", "_"): words[i + 1] for i in range(2, len(words) - 1)
               if words[i].startswith("--") and not words[i + 1].startswith("--")}
    assert ran["model"] == "tiny" and ran["nproc"] == 2
    assert {k: str(ran[k]) for k in LAYOUT if k in planned} == {k: planned[k] for k in LAYOUT if k in planned}
    assert ran["steps"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_printed_torchrun_line_starts_the_run_on_two_nodes_once_head_node_is_filled(tmp_path: Path) -> None:
    """Each of two nodes runs the printed line through bash with HEAD_NODE set to node 0's address: on the
    multi-node test bed (two network namespaces over a rate-limited link) where namespaces can be made, else
    two "nodes" on 127.0.0.1 with the rendezvous port moved to a free one."""
    printed = _printed(["--model", "tiny", "--gpus", "4", "--gpus-per-node", "2", "--gpu", "cpu",
                        "--global-batch", "8"])
    assert printed.startswith("torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d")
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"RUN_ID": "plan-test", "OMP_NUM_THREADS": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])}
    tail = " --steps 2 --out run --no-tensorboard --no-progress"
    if missing_capability() is None:
        with TestBed(2, rate_mbit=200) as bed:
            env["HEAD_NODE"] = bed.members[0].addr
            _both_finish([bed.start(k, ["bash", "-c", printed + tail], env=env, cwd=tmp_path,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for k in range(2)])
            assert bed.link_bytes() > 0
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env |= {"HEAD_NODE": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
        _both_finish([subprocess.Popen(["bash", "-c", printed.replace(":29500", f":{port}") + tail], cwd=tmp_path,
                                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                      for _ in range(2)])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 4


def _both_finish(nodes: list[subprocess.Popen]) -> None:
    try:
        errors = [node.communicate(timeout=240)[1] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, err in zip(nodes, errors):
        assert node.returncode == 0, err[-3000:]
