"""One save path: ``trainmesh train`` saves through ``tm.save``, so a script saving the same run writes the same
manifest, and the lock on a checkpoint directory belongs to a run, so the CLI's claim and its ranks' saves (in
its process or the ones it starts) take it once while any other run is refused."""

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import trainmesh as tm
from trainmesh import api
from trainmesh.app import checkpoints
from trainmesh.app.config import Config
from trainmesh.app.train import build
from trainmesh.checkpoint import LOCK, CheckpointError, TrainingProgress, read_manifest, step_dir
from trainmesh.checkpoint.store import RUN_ID_ENV
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import spec_of
from trainmesh.tracking import runlock

from runs import config

RUN = "0123456789abcdef0123456789abcdef"


def _tiny() -> tuple[tm.ParallelModel, tm.Optimizer]:
    model = tm.parallelize(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)),
                           Mesh.build(1, 1, 1, torch.device("cpu")))
    return model, tm.optimizer(model, lr=1e-2)


def test_the_cli_saves_through_tm_save_and_a_script_saving_the_same_run_writes_the_same_manifest(tmp_path,
                                                                                                 monkeypatch):
    cfg = config(checkpoint_dir=str(tmp_path / "cli"), precision="fp64", zero=1, microbatches=2)
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    done = dataclasses.replace(checkpoints.restore(run), step=3)
    saved_by = []
    real_save = api.save
    monkeypatch.setattr(api, "save", lambda *args, **kw: saved_by.append(args[0]) or real_save(*args, **kw))
    cli = read_manifest(checkpoints.save(run, done))
    monkeypatch.undo()  # before the script's tm.save, which trainmesh resolves (and keeps) on first use
    assert saved_by == [run.parallel]

    model = spec_of(cfg.model.model).builder(cfg.model_config, cfg.model.seed).to(torch.float64)
    script = tm.parallelize(model, run.mesh, zero=1, microbatches=2, precision="fp64")
    theirs = read_manifest(tm.save(script, tm.optimizer(script), tmp_path / "script", done, run.tokenizer,
                                   config=cfg.settings()))
    assert cli["layout"] == theirs["layout"] == {"world_size": 1, "dp": 1, "dp_replicate": 1, "cp": 1, "tp": 1,
                                                 "pp": 1, "ep": 1, "etp": 1, "zero": 1, "microbatches": 2, "schedule": "1f1b",
                                                 "precision": "fp64"}
    assert cli["model_source"] == {"family": "gpt", "source": cfg.model.model}
    assert theirs["model_source"]["family"] == "gpt"
    differ = {k for k in cli if cli[k] != theirs[k]}
    assert differ == {"model_source", "files", "sha256"}, differ  # the name, and the bytes of rng and the hash


def test_a_script_saves_under_the_lock_it_holds_for_its_run_and_another_run_is_refused(tmp_path):
    with runlock.hold(tmp_path, "--checkpoint-dir", LOCK) as lock:
        lock.note(run_id=RUN)
        model, opt = _tiny()
        assert tm.save(model, opt, tmp_path, TrainingProgress(1, run_id=RUN)) == step_dir(tmp_path, 1)
        assert tm.save(model, opt, tmp_path, TrainingProgress(2, run_id=RUN)) == step_dir(tmp_path, 2)
        with pytest.raises(CheckpointError, match=rf"in use by another live run: pid {os.getpid()} on host .* "
                                                  rf"\(this process\), run \"{RUN}\""):
            tm.save(*_tiny(), tmp_path, step=3)
        assert read_manifest(step_dir(tmp_path, 2))["run"]["id"] == RUN
    assert not (tmp_path / LOCK).exists(), "the script's hold released it: no save took it again on top"


def _save_in_another_process(root: Path, step: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import torch, trainmesh as tm
        model = tm.parallelize(torch.nn.Linear(4, 4), tm.init_mesh())
        tm.save(model, tm.optimizer(model), {str(root)!r}, step={step})
    """)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_ranks_a_claiming_process_starts_save_under_its_lock_and_another_process_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    with checkpoints.claim(Config.from_settings(checkpoint_dir=str(root))) as run_id:  # as trainmesh train's launcher does
        rank = _save_in_another_process(root, 1, dict(os.environ))  # inherits TRAINMESH_RUN_ID
        other = _save_in_another_process(root, 2, {k: v for k, v in os.environ.items() if k != RUN_ID_ENV})
    assert rank.returncode == 0, rank.stderr
    assert read_manifest(step_dir(root, 1))["run"]["id"] == run_id
    assert other.returncode != 0 and not step_dir(root, 2).exists()
    assert f"in use by another live run: pid {os.getpid()} on host" in other.stderr
    assert f'run "{run_id}"' in other.stderr
