"""Sharded checkpoints (checkpoint.py): any layout reads what any other wrote, a resumed run continues bit for
bit, the weights export to one plain file and back, and every kind of damage is named, never loaded."""

import dataclasses
import errno
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from trainmesh import checkpoint

from trainmesh.storage import safe_io
from trainmesh.app import checkpoints
from trainmesh.checkpoint import CheckpointError, CheckpointMismatch, read_tensors, step_dir
from trainmesh.checkpoint.store import flat_range_boxes, region, whole
from trainmesh.app.config import Config
from trainmesh.distributed.mesh import Mesh, world_from_env
from trainmesh.parallel.tensor_parallel import ShardSpec, shard_tensor, spec_boxes
from trainmesh.distributed.testing import run_ranks
from trainmesh.app.train import build, setup_process, train

from helpers import EQUIVALENCE_TABLE, FP64_ATOL
from runs import config

SAVE_AT = 5
WORLD = 4

# Layouts trained 10 steps (saving at 5 and 10), then resumed from step 5 in fresh processes. dp4 and every
# layout that reshards its checkpoint train in float64, so the resharded runs are held to the equivalence
# bound (tests/helpers.py).
SAME_LAYOUT = {
    "dp4": {"dp": 4, "precision": "fp64"},
    "dp2-tp2-zero3": {"dp": 2, "tp": 2, "zero": 3},
    "pp2-tp2-fp16": {"pp": 2, "tp": 2, "precision": "fp16", "microbatches": 2},
    "dp2-pp2-zero2-bf16": {"dp": 2, "pp": 2, "zero": 2, "precision": "bf16", "microbatches": 2},
}
# Layouts that load dp4's step-5 checkpoint.
RESHARD = {
    "dp2-tp2": {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True, "precision": "fp64"},
    "dp2-pp2": {"dp": 2, "pp": 2, "zero": 1, "microbatches": 2, "precision": "fp64"},
    "dp2-cp2": {"dp": 2, "cp": 2, "zero": 3, "precision": "fp64"},  # ZeRO-3 shards over dp x cp
}


def _cfg(root: Path, name: str, **kw) -> Config:
    return config(checkpoint_every=SAVE_AT, checkpoint_dir=str(root / name), **kw)


def _copy_step(src_root: Path, dst_root: Path, step: int = SAVE_AT) -> None:
    """Make ``dst_root`` a checkpoint directory whose latest checkpoint is ``src_root``'s step ``step``."""
    shutil.copytree(step_dir(src_root, step), step_dir(dst_root, step))
    (dst_root / "latest").write_text(step_dir(dst_root, step).name + "\n")


def _exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def _model(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}


def _training_state(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor but the per-rank RNG states, and the non-tensor state, of a checkpoint."""
    manifest = checkpoint.read_manifest(path)
    tensors = {k: v for k, v in read_tensors(path).items() if not k.startswith("rng/")}
    return tensors, {k: manifest[k] for k in ("step", "progress", "loss_scaler")}


# --- rank functions (world 4) ------------------------------------------------------------------------

def _load_and_resave(cfg: Config, mesh: Mesh, resaved: Path) -> dict[str, torch.Tensor]:
    """Load ``cfg``'s checkpoint into its layout, save it straight back to ``resaved``; the full parameters."""
    run = build(cfg, mesh)
    progress = checkpoints.restore(run)
    checkpoints.save(dataclasses.replace(run, cfg=cfg.replace(checkpoint_dir=str(resaved))), progress)
    return run.parallel.state_dict()


def _train_and_reshard(root: Path, same: dict[str, Config], reshard: dict[str, Config], imported: Config) -> dict:
    torch.set_num_threads(1)
    out: dict = {"trained": {}, "resharded": {}}
    for name, cfg in same.items():
        result = train(cfg)
        out["trained"][name] = (result.losses, result.run.parallel.state_dict())
    if world_from_env()[0] == 0:
        for name in reshard:
            _copy_step(root / "dp4", root / name)
        checkpoint.export(root / "dp4", root / "model.safetensors")
    dist.barrier()
    for name, cfg in reshard.items():
        loaded = _load_and_resave(cfg, setup_process(cfg), root / f"{name}-resaved")
        out["resharded"][name] = (loaded, train(cfg).losses)
    run = build(imported, setup_process(imported))
    checkpoints.restore(run)
    out["imported"] = run.parallel.state_dict()
    return out


class _FillingFile:
    """A file that takes ``room`` bytes and then fails as a full disk does."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.f.name)
        n = self.f.write(data[:self.room])
        self.room -= n
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()


def _disk_full_on_rank_1(cfg: Config) -> str:
    if world_from_env()[0] == 1:
        real = open
        safe_io.open = lambda path, mode="r", *a, **k: _FillingFile(real(path, mode, *a, **k), 1000)
    try:
        train(cfg)
    except CheckpointError as e:
        return str(e)
    return "no error"


def _resume_fresh(same: dict[str, Config], disk_full: Config) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, cfg in same.items():
        result = train(cfg)
        out[name] = (result.losses, result.run.parallel.state_dict())
    out["disk_full"] = _disk_full_on_rank_1(disk_full)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One world-4 spawn: every SAME_LAYOUT run, then dp4's step 5 loaded into each RESHARD layout (loaded,
    saved straight back, and trained on), and dp4's exported weights imported at dp2 x tp2."""
    root = tmp_path_factory.mktemp("ckpt")
    same = {name: _cfg(root, name, **kw) for name, kw in SAME_LAYOUT.items()}
    reshard = {name: _cfg(root, name, resume=True, **kw) for name, kw in RESHARD.items()}
    imported = _cfg(root, "imported", dp=2, tp=2, precision="fp64", init_from=str(root / "model.safetensors"))
    return root, run_ranks(_train_and_reshard, WORLD, root, same, reshard, imported, timeout=400)[0]


@pytest.fixture(scope="module")
def resumed(trained):
    """A second spawn (fresh processes): every SAME_LAYOUT run resumed from a copy of its step 5, and a
    resumed dp4 run whose next save meets a full disk on rank 1."""
    root, _ = trained
    same = {}
    for name, kw in SAME_LAYOUT.items():
        _copy_step(root / name, root / f"{name}-again")
        same[name] = _cfg(root, f"{name}-again", resume=True, **kw)
    _copy_step(root / "dp4", root / "disk-full")
    disk_full = _cfg(root, "disk-full", resume=True, dp=4)
    return root, run_ranks(_resume_fresh, WORLD, same, disk_full, timeout=400)


# --- resharding, resuming, export -------------------------------------------------------------------

def test_dp4_checkpoint_loads_into_dp2_tp2_pp2_and_one_process(trained, tmp_path):
    root, out = trained
    saved_tensors, saved_state = _training_state(step_dir(root / "dp4", SAVE_AT))
    reference_losses = out["trained"]["dp4"][0][SAVE_AT:]

    single = _cfg(tmp_path, "single", resume=True, precision="fp64")
    _copy_step(root / "dp4", tmp_path / "single")
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    results = {name: out["resharded"][name] for name in RESHARD}
    results["single"] = (_load_and_resave(single, mesh, tmp_path / "single-resaved"), train(single, mesh).losses)

    for name, (loaded, losses) in results.items():
        resaved = (tmp_path if name == "single" else root) / f"{name}-resaved"
        tensors, state = _training_state(step_dir(resaved, SAVE_AT))
        _exact(tensors, saved_tensors)
        assert state == saved_state
        _exact(loaded, _model(saved_tensors))
        assert len(losses) == len(reference_losses) == 5
        for step, (a, b) in enumerate(zip(losses, reference_losses), start=SAVE_AT):
            assert abs(a - b) <= FP64_ATOL, f"{name} step {step}: loss {a} vs uninterrupted dp4 {b}"
        # the loaded state is bit-exact (above); the losses after it as measured
        EQUIVALENCE_TABLE.append((f"dp4 checkpoint resumed at {name}", max(abs(a - b) for a, b in
                                                                           zip(losses, reference_losses)), 0.0))


def test_resume_in_fresh_processes_is_bit_identical(trained, resumed):
    root, first = trained
    _, again = resumed
    for name in SAME_LAYOUT:
        losses, params = first["trained"][name]
        resumed_losses, resumed_params = again[0][name]
        assert resumed_losses == losses[SAVE_AT:], name
        _exact(resumed_params, params)
        # every tensor of the final state, the generators too (each fresh process starts from a random one)
        _exact(read_tensors(step_dir(root / f"{name}-again", 10)), read_tensors(step_dir(root / name, 10)))


def test_every_rank_writes_its_own_share_once(trained):
    root, _ = trained
    manifest = checkpoint.read_manifest(step_dir(root / "dp2-tp2-zero3", SAVE_AT))
    assert sorted(manifest["files"]) == [f"rank-{r:05d}.safetensors" for r in range(WORLD)]
    sizes = [f["bytes"] for f in manifest["files"].values()]
    assert max(sizes) < 1.5 * min(sizes), f"unbalanced writes {sizes}"
    qkv = manifest["tensors"]["model/blocks.0.attn.qkv.weight"]
    assert len(qkv["pieces"]) >= 6, "tp=2 x zero=3 holds row blocks of q, k and v on each rank"
    dp4 = checkpoint.read_manifest(step_dir(root / "dp4", SAVE_AT))
    assert all(len(entry["pieces"]) == 1 for name, entry in dp4["tensors"].items()), "replicas are written once"


def test_export_writes_the_plain_model_and_init_from_loads_it_in_another_layout(trained, tmp_path):
    root, out = trained
    exported = safetensors.torch.load_file(root / "model.safetensors")
    _exact(exported, out["trained"]["dp4"][1])
    _exact(out["imported"], exported)
    again = tmp_path / "again.safetensors"
    result = subprocess.run([sys.executable, "-m", "trainmesh", "export", str(step_dir(root / "dp4", 10)),
                             "--to", str(again)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "wrote 29 tensors" in result.stdout
    _exact(safetensors.torch.load_file(again), exported)


def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(resumed):
    root, out = resumed
    messages = [rank_out["disk_full"] for rank_out in out]
    for message in messages:
        assert "rank(s) [1]" in message and "No space left on device" in message, message
        assert "step-00000005) is untouched" in message
    ckpt = root / "disk-full"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-00000005"]
    assert (ckpt / "latest").read_text().strip() == "step-00000005"
    read_tensors(step_dir(ckpt, SAVE_AT))


# --- damage ------------------------------------------------------------------------------------------

class Payload:
    """Unpickling this creates ``path``: the test's proof that nothing was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A single-process run's checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    cfg = _cfg(root.parent, "ckpt").replace(steps=4, checkpoint_every=2)
    train(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    return root


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _forge_hashes(step: Path, shard: Path, data: bytes) -> None:
    """Replace ``shard`` with ``data`` and rewrite the manifest's hashes to match, as a tamperer could."""
    shard.write_bytes(data)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][shard.name] = {"sha256": safe_io.sha256_hex(data), "bytes": len(data)}
    manifest["sha256"] = checkpoint.store.content_hash(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


SHARD, MANIFEST = "rank-00000.safetensors", "manifest.json"
DAMAGE = {
    "flipped byte": (lambda step, payload: _flip_byte(step / SHARD), f"{SHARD} does not match the SHA-256"),
    "truncated shard": (lambda step, payload: _truncate(step / SHARD), f"{SHARD} has "),
    "missing shard": (lambda step, payload: (step / SHARD).unlink(), f"{SHARD} is missing"),
    "torn manifest": (lambda step, payload: _truncate(step / MANIFEST), f"{MANIFEST} is not valid JSON"),
    "pickled manifest": (lambda step, payload: (step / MANIFEST).write_bytes(pickle.dumps(payload)),
                         f"{MANIFEST} is not valid JSON"),
    "pickled shard": (lambda step, payload: (step / SHARD).write_bytes(pickle.dumps(payload)), f"{SHARD} has "),
    "edited manifest": (lambda step, payload: (step / MANIFEST).write_text(
        (step / MANIFEST).read_text().replace('"scale": 1.0', f'"scale": "{pickle.dumps(payload).hex()}"')),
        f"{MANIFEST} does not match its own SHA-256"),
    "pickled shard with forged hashes": (lambda step, payload: _forge_hashes(step, step / SHARD,
                                                                             pickle.dumps(payload)),
                                         f"{MANIFEST}: the pieces in {SHARD} need"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_named_and_resume_falls_back_to_the_previous_checkpoint(saved, tmp_path, capsys, case):
    damage, message = DAMAGE[case]
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    sentinel = tmp_path / "payload-ran"
    damage(step_dir(root, 4), Payload(sentinel))

    with pytest.raises(CheckpointError, match="step-00000004/" + message.split(" ")[0]) as error:
        read_tensors(step_dir(root, 4))
    assert message in str(error.value)

    cfg = _cfg(tmp_path, "ckpt", resume=True).replace(steps=6)
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    capsys.readouterr()
    assert checkpoints.resume(run).step == 2
    err = capsys.readouterr().err
    assert "step-00000004 is damaged" in err and message in err and "falling back" in err
    _exact(run.parallel.state_dict(), _model(read_tensors(step_dir(saved, 2))))
    assert not sentinel.exists(), "a pickle payload ran"


def test_a_save_torn_by_a_crash_is_ignored_and_replaced(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    torn = root / ".tmp-step-00000006"
    torn.mkdir()
    (torn / SHARD).write_bytes((root / "step-00000004" / SHARD).read_bytes()[:1000])
    cfg = _cfg(tmp_path, "ckpt", resume=True).replace(steps=6, checkpoint_every=2)
    result = train(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    assert len(result.losses) == 2
    # the lock: the run that saved there (through tm.save) holds the directory while it lives, as result.run does
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000002", "step-00000004", "step-00000006",
                                                      checkpoint.LOCK]
    assert (root / "latest").read_text().strip() == "step-00000006"


def test_a_checkpoint_of_another_model_is_refused(saved, tmp_path):
    cfg = _cfg(saved.parent, "ckpt", model="tiny-deep", resume=True)
    with pytest.raises(CheckpointMismatch, match="holds a different model .*n_layers 2 there, 8 here"):
        checkpoints.restore(build(cfg, Mesh.build(1, 1, 1, torch.device("cpu"))))
    result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--model", "small", "--resume",
                             "--checkpoint-dir", str(saved), "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds a different model (tiny: n_layers 2 there, 4 here" in lines[0], result.stderr
    assert "resume without --model/--init-hf to continue it" in lines[0]


# --- restarts (issue #9) -----------------------------------------------------------------------------

def _trainmesh_timed(args: list[str], env: dict) -> tuple[int, list[tuple[float, str]]]:
    """Run the CLI; its exit code and stderr lines, each with the time it arrived."""
    proc = subprocess.Popen([sys.executable, "-m", "trainmesh", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    lines = [(time.monotonic(), line.rstrip()) for line in proc.stderr]
    return proc.wait(timeout=300), lines


def _first(lines: list[tuple[float, str]], text: str) -> float:
    return next(t for t, line in lines if text in line)


@pytest.mark.slow  # a restart after a killed rank stays in the default set: test_reliability's restarted run
def test_a_killed_rank_is_restarted_from_the_checkpoint_and_the_run_ends_bit_equal(tmp_path):
    common = ["train", "--nproc", "2", "--dp", "2", "--steps", "10", "--global-batch", "8", "--warmup-steps", "2",
              "--checkpoint-every", "2", "--no-progress"]
    clean = tmp_path / "clean"
    rc, _ = _trainmesh_timed([*common, "--checkpoint-dir", str(clean), "--out", str(tmp_path / "r1")], {})
    assert rc == 0
    faulty = tmp_path / "faulty"
    rc, lines = _trainmesh_timed([*common, "--checkpoint-dir", str(faulty), "--out", str(tmp_path / "r2"),
                                  "--max-restarts", "1"], {"TRAINMESH_FAULT": "kill@1:5"})
    text = "\n".join(line for _, line in lines)
    assert rc == 0, text
    named = _first(lines, "rank 1 failed (killed by signal SIGKILL)")
    assert named - _first(lines, f"saved {step_dir(faulty, 4)}") < 5, "the failure was named more than 5 s after it"
    assert "restarting all 2 rank(s) from the latest complete checkpoint (restart 1 of 1)" in text
    assert f"resumed from {step_dir(faulty, 4)} (step 4)" in text
    for state in ("model/", "optim/"):  # RNG states differ: torch seeds its generator afresh in each process
        _exact(read_tensors(step_dir(faulty, 10), state), read_tensors(step_dir(clean, 10), state))


# --- geometry ----------------------------------------------------------------------------------------

def test_flat_ranges_become_boxes_holding_exactly_those_elements():
    shape = (5, 6, 7)
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    rng = random.Random(0)
    for _ in range(300):
        a = rng.randrange(0, full.numel())
        b = rng.randrange(a + 1, full.numel() + 1)
        boxes = flat_range_boxes([whole(shape)], a, b)
        assert len(boxes) <= 2 * len(shape) - 1
        assert torch.equal(torch.cat([region(full, box, whole(shape)).flatten() for box in boxes]),
                           full.flatten()[a:b])


@pytest.mark.parametrize("spec", [ShardSpec(0), ShardSpec(1), ShardSpec(0, chunks=3), ShardSpec(0, chunks=2)],
                         ids=str)
def test_tensor_parallel_boxes_are_where_shard_tensor_takes_each_shard_from(spec):
    full = torch.arange(24 * 8).view(24, 8)
    for rank in range(2):
        local = shard_tensor(full, spec, rank, 2)
        shape, boxes = spec_boxes(local.shape, spec, rank, 2)
        assert shape == full.shape
        assert torch.equal(torch.cat([region(full, box, whole(tuple(shape))).flatten() for box in boxes]),
                           local.flatten())
        # a ZeRO shard of that tp shard: a flat range of it, again as boxes of the full tensor
        pieces = flat_range_boxes(boxes, 5, 77)
        assert torch.equal(torch.cat([region(full, box, whole(tuple(shape))).flatten() for box in pieces]),
                           local.flatten()[5:77])
