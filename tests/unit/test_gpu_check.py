"""The GPU check cannot be run here (no GPU), so what can go stale without one is checked: every case's
``trainmesh train`` line is a configuration that validates at one GPU and at eight."""

import importlib.util
import sys
from pathlib import Path

import pytest

from trainmesh.app.cli import _parser
from trainmesh.app.config import config_from_args, validate

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("gpus", [1, 8])
def test_every_gpu_check_case_is_a_valid_train_command(gpus: int, tmp_path: Path) -> None:
    gpu_check = load_script()
    args = gpu_check.parse_args([])
    for case in gpu_check.CASES:
        argv = gpu_check.train_command(case, args, gpus, tmp_path / "run")[3:]  # drop python -m trainmesh
        cfg = config_from_args(_parser().parse_args(argv))
        validate(cfg, world_size=gpus, cuda_devices=gpus)
        assert (cfg.device, cfg.precision, cfg.compile, cfg.dp) == ("cuda", "bf16", case.compile, gpus), case.name
        assert cfg.model == (args.larger_model if case.larger else args.model)
        assert cfg.global_batch == gpus * (args.larger_batch_per_gpu if case.larger else args.batch_per_gpu)


def test_the_table_marks_a_failed_case_and_unknown_mfu() -> None:
    gpu_check = load_script()
    rows = [{"case": "a", "error": "exit 1: CUDA out of memory"},
            {"case": "b", "model": "m", "micro_batch": 8, "tokens_per_s": 1234.5, "median_tokens_per_s": 1300.0,
             "mfu": None, "peak_gib": 1.5, "loss": "1 -> 0.5"}]
    text = gpu_check.table(rows, 1)
    assert "failed: exit 1: CUDA out of memory" in text and "| b | m | 1 | 8 | 1,234 | 1,300 | n/a | 1.50 GiB |" in text
