"""What ``trainmesh plan`` prints and writes: the precision it resolved, rows fastest first with why the
chosen one beat the runner-up, and the command lines (one node, several under torchrun, an sbatch script)
that start the chosen run. Pure: no rank is started (``tests/cli/test_plan_runs.py`` runs one)."""

from __future__ import annotations

import argparse
import functools
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from trainmesh.app import cli
from trainmesh.app.config import Config, config_from_args
from trainmesh.app.planning import add_plan_arguments, layout_of, plan_from_args
from trainmesh.layout import resolve_precision


@functools.cache  # the 70B plan is read by several tests
def _plan(argv: str) -> list[str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return plan_from_args(parser.parse_args(argv.split())).splitlines()


SEVENTY_B = "--model llama3-70b --gpus 64 --gpu h100-80gb --global-batch 512 --top 10"


def _train_config(line: str) -> Config:
    words = shlex.split(line)
    return config_from_args(cli._parser().parse_args(words[words.index("train"):]))


@pytest.mark.parametrize("gpu,precision", [("h100-80gb", "bf16"), ("a100-80gb", "bf16"), ("cpu", "fp32")])
def test_auto_precision_is_bf16_on_gpus_and_fp32_on_cpu_and_the_plan_says_so(gpu: str, precision: str) -> None:
    lines = _plan(f"--model small --gpus 8 --gpu {gpu} --global-batch 16 --top 2")
    assert f"precision {precision} (auto" in lines[0]
    assert _train_config(lines[-1]).layout.precision == precision


def test_train_resolves_auto_through_the_same_function_as_plan() -> None:
    assert Config.from_settings(device="cpu").layout.precision == resolve_precision("auto", False) == "fp32"
    assert resolve_precision("auto", True) == "bf16" and resolve_precision("fp16", True) == "fp16"


def test_rows_are_sorted_by_step_time_and_the_choice_names_its_runner_up() -> None:
    lines = _plan(SEVENTY_B)
    rows = lines[2:12]
    times = [float(row.split()[-3]) for row in rows]
    assert times == sorted(times) and sum(row.startswith("*") for row in rows) == 1
    why = next(line for line in lines if line.startswith("why: "))
    assert "the runner-up (dp=" in why and "free per rank against" in why


def test_several_nodes_get_the_whole_torchrun_rendezvous_and_the_line_parses_back_to_the_layout() -> None:
    lines = _plan(SEVENTY_B)
    words = shlex.split(lines[-1])
    assert words[:5] == ["torchrun", "--nnodes", "8", "--nproc-per-node", "8"]
    assert words[words.index("--rdzv-backend") + 1] == "c10d" and "--rdzv-id" in words
    assert words[words.index("--rdzv-endpoint") + 1].startswith("${HEAD_NODE:?")
    assert lines[-2].startswith("# on each of the 8 nodes, with HEAD_NODE set")
    cfg = _train_config(lines[-1])
    assert (cfg.model.model, cfg.layout.precision, cfg.layout.world) == ("llama3-70b", "bf16", 64)


def test_the_placeholder_stops_the_shell_until_it_is_filled() -> None:
    line = _plan(SEVENTY_B)[-1]
    head = line.split(" -m trainmesh")[0].replace("torchrun", "echo", 1)
    unset = subprocess.run(["bash", "-c", head], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert unset.returncode != 0 and "set HEAD_NODE to the address of the first node" in unset.stderr
    filled = subprocess.run(["bash", "-c", head], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HEAD_NODE": "node001"})
    assert "--rdzv-endpoint node001:29500 --rdzv-id trainmesh" in filled.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_slurm_script_is_valid_bash_with_one_torchrun_task_per_node(tmp_path: Path) -> None:
    script = tmp_path / "run.sbatch"
    lines = _plan(f"--model llama3-70b --gpus 64 --gpu h100-80gb --global-batch 512 --top 1 --slurm {script}")
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    for directive in ("--nodes=8", "--ntasks-per-node=1", "--gpus-per-node=8"):
        assert f"#SBATCH {directive}\n" in text
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    srun = text.splitlines()[-1]
    assert srun.startswith("srun torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d")
    assert '"$HEAD_NODE:29500" --rdzv-id "$SLURM_JOB_ID"' in srun
    assert layout_of(_train_config(srun)) == layout_of(_train_config(lines[-2]))


def test_a_custom_shape_is_never_silently_dropped() -> None:
    lines = _plan("--layers 4 --hidden 256 --heads 4 --vocab 1024 --seq 128 --gpus 2 --gpu cpu --global-batch 4")
    assert lines[-2].startswith("# this custom shape is a shape only the planner knows") and "docs/api.md" in lines[-2]
    assert "--model" not in lines[-1]


def test_plan_published_prints_each_run_beside_the_planners_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trainmesh plan --published`` needs no --gpus: each published run's layout and the planner's with both
    figures, the reason, and the error against its bound (one run here: each is a search)."""
    from trainmesh.plan import published

    llama = next(r for r in published.PUBLISHED if r.name.startswith("Llama 3 8B"))
    monkeypatch.setattr(published, "PUBLISHED", (llama,))
    lines = _plan.__wrapped__("--published")
    assert lines[0].startswith("Llama 3 8B FP8, 8 H100 (published 14,451 tokens/s/GPU)")
    assert [line.split(":")[0].strip() for line in lines[1:4]] == ["published", "planner", "why"]
    assert f"error {published.error(llama):+.1%}, within the 10%" in lines[4]


def test_plan_without_gpus_says_to_give_them() -> None:
    with pytest.raises(ValueError, match="give --gpus N"):
        _plan.__wrapped__("--model small")
