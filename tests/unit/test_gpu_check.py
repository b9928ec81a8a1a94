"""The GPU check cannot be run here (no GPU), so what can go stale without one is checked: every case's
``trainmesh train`` line is a configuration that validates at one GPU and at eight, the 7B-class model is
sized to the GPU, and the report marks failures, unknown MFU, FP8's loss gap and the goals."""

import importlib.util
import sys
from pathlib import Path

import pytest

from trainmesh.app.cli import _parser
from trainmesh.app.config import config_from_args, validate

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str = "gpu_check"):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [1, 8])
def test_every_gpu_check_case_is_a_valid_train_command(gpus: int, tmp_path: Path) -> None:
    gpu_check, resized = load_script(), load_script("train_resized")
    args = gpu_check.parse_args(["--big-layers", "16"])
    for case in gpu_check.selected("all"):
        cmd = gpu_check.train_command(case, args, gpus, tmp_path / "run")
        argv = resized.resized(cmd[3:], 16) if case.model == "big" else cmd[4:]  # drop python -m trainmesh train
        cfg = config_from_args(_parser().parse_args(["train", *argv]))
        ranks = 1 if case.model == "big" else gpus
        validate(cfg, world_size=ranks, cuda_devices=gpus, cuda_capability=(9, 0))
        assert (cfg.launch.device, cfg.layout.precision, cfg.layout.compile, cfg.layout.dp) == ("cuda", case.precision, case.compile, ranks)
        assert cfg.layout.cuda_graphs == ("--cuda-graphs" in case.flags)
        assert cfg.optim.global_batch == ranks * gpu_check.micro_batch(case, args)
        assert cfg.model.model == (f"{args.big_model}-16l" if case.model == "big" else gpu_check.model_of(case, args))
    assert [c.key for c in gpu_check.selected(gpu_check.parse_args([]).cases)] == list(gpu_check.DEFAULT_CASES)
    with pytest.raises(SystemExit, match="unknown case 'nope'"):
        gpu_check.selected("compiled,nope")


def test_the_7b_class_model_gets_the_layers_whose_state_fits_four_fifths_of_the_gpu() -> None:
    """20 bytes per parameter, 202.4M per layer and 262.1M outside the layers: an H100 (81,559 MiB as torch
    reports it) holds (0.8 * 85.52e9 / 20 - 262.1M) / 202.4M = 15.6 layers, an H200 (143,771 MiB) 28.5."""
    gpu_check = load_script()
    assert gpu_check.layers_one_gpu_holds("llama-7b", 81559 * 2**20) == 15
    assert gpu_check.layers_one_gpu_holds("llama-7b", 143771 * 2**20) == 28
    assert gpu_check.layers_one_gpu_holds("llama-7b", 10**9) == 1
    assert gpu_check.layers_one_gpu_holds("llama-7b", 10**12) == 32


def _row(key: str, tokens: float, last_loss: float, mfu: float | None = 0.4) -> dict:
    return {"case": key, "key": key, "model": "m", "gpus": 1, "micro_batch": 8, "tokens_per_s": tokens,
            "median_tokens_per_s": tokens, "mfu_bf16": mfu, "mfu_fp8": None if mfu is None else mfu / 2,
            "peak_gib": 1.5, "last_loss": last_loss, "loss": "1 -> 0.5"}


def test_the_report_marks_failures_unknown_mfu_fp8_loss_gaps_and_each_goal() -> None:
    gpu_check = load_script()
    rows = [_row("compiled", 1000, 3.0, mfu=None), _row("graphs", 1200, 3.0, mfu=0.52), _row("fp8", 1500, 3.06),
            _row("big-bf16", 100, 2.0), {"case": "7B-class FP8", "key": "big-fp8", "error": "exit 1: CUDA out of memory"}]
    text = gpu_check.table(rows)
    assert "| compiled | m | 1 | 8 | 1,000 | 1,000 | n/a | n/a | 1.50 GiB | 1 -> 0.5 |  |" in text
    assert "| 52.0% | 26.0% |" in text and "| +2.00% |" in text
    assert "failed: exit 1: CUDA out of memory" in text
    assert gpu_check.goals(rows) == [
        "- MFU >= 50 % (small model, bf16, compiled): met (52.0%)",
        "- FP8 >= 1.3x bf16 tokens/s (7B-class): not measured",
        "- FP8 loss within 1 % of bf16 (+ CUDA graphs + FP8 linears): missed (+2.00%)",
        "- FP8 loss within 1 % of bf16 (7B-class, ZeRO-3, full recompute, FP8): not measured"]
    report = gpu_check.report(rows, "cpu", 1, 30, 15)
    assert report.startswith("### ") and "torch " in report and "torchao " in report and "15 layers" in report
