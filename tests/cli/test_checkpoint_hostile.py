"""Hostile checkpoints and runs that would mix (issue 15): a reader that trusts nothing on disk, and run
identity. Every damage is one line naming the file, then a fallback to an earlier checkpoint of the same
run; nothing outside the step directory is read; no two runs share a checkpoint directory.

The fuzzer mutates a tiny saved checkpoint's manifest, file names and safetensors header (re-hashing them
as a tamperer would) and loads each mutant in this process, with an audit hook recording every file
opened and a timer per case."""

import fcntl
import functools
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from trainmesh import api, checkpoint

from trainmesh.storage import safe_io
from trainmesh.app import checkpoints
from trainmesh.app import cli
from trainmesh.checkpoint import (LOCK, CheckpointDamaged, CheckpointError, CheckpointMismatch, read_manifest,
                                  read_tensors, step_dir)
from trainmesh.checkpoint.store import RUN_ID_ENV
from trainmesh.app.config import Config
from trainmesh.checkpoint.manifest import ManifestError, check_manifest, check_tiling
from trainmesh.distributed.mesh import Mesh
from trainmesh.app.train import build, train

SHARD, MANIFEST = "rank-00000.safetensors", "manifest.json"
OTHER_RUN = "0123456789abcdef0123456789abcdef"

from fuzz import CaseTimeout, deadline, json_nodes
from runs import config


def _cfg(root: Path, **kw) -> Config:
    return config(**{"steps": 4, "global_batch": 4, "warmup_steps": 1, "checkpoint_every": 2,
                     "checkpoint_dir": str(root), **kw})


def _mesh() -> Mesh:
    return Mesh.build(1, 1, 1, torch.device("cpu"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A single-process run's checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    train(_cfg(root), _mesh())
    return root


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    return root


def _edit(step: Path, change) -> None:
    """Apply ``change`` to the manifest of ``step`` and re-hash it, as someone with write access could."""
    manifest = json.loads((step / MANIFEST).read_text())
    change(manifest)
    manifest["sha256"] = checkpoint.store.content_hash(manifest)
    (step / MANIFEST).write_text(json.dumps(manifest))


def _rename_shard(manifest: dict, name: str) -> None:
    old = next(iter(manifest["files"]))
    manifest["files"][name] = manifest["files"].pop(old)
    for entry in manifest["tensors"].values():
        for piece in entry["pieces"]:
            piece["file"] = name


def _replace_tensor(step: Path, key: str, value: torch.Tensor) -> None:
    """Rewrite the shard with ``key`` replaced and forge the manifest's hash of it."""
    tensors = safetensors.torch.load((step / SHARD).read_bytes())
    tensors[key] = value
    data = safetensors.torch.save(tensors)
    (step / SHARD).write_bytes(data)
    _edit(step, lambda m: m["files"].__setitem__(SHARD, {"sha256": safe_io.sha256_hex(data), "bytes": len(data)}))


def _one_line(error: BaseException, step: Path) -> str:
    text = str(error)
    assert "\n" not in text, text
    assert f"checkpoint {step} is damaged: {step}/" in text, text
    return text


def _resumed_falls_back_to_step_2(root: Path, capsys) -> str:
    """Resume from ``root`` (step 4 damaged): lands on step 2, equal to it; the notice rank 0 printed."""
    run = build(_cfg(root, resume=True, steps=6), _mesh())
    capsys.readouterr()
    assert checkpoints.resume(run).step == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "is damaged" in line]
    assert len(lines) == 1 and "falling back to the previous complete checkpoint" in lines[0], err
    expected = {k.removeprefix("model/"): v for k, v in read_tensors(step_dir(root, 2), "model/").items()}
    got = run.parallel.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    return lines[0]


# --- security: names, file kinds, sizes ----------------------------------------------------------------

def _outside_copy(root: Path) -> Path:
    """A valid shard (step 2's) outside the checkpoint directory; loading it would change the state."""
    outside = root.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copy(step_dir(root, 2) / SHARD, outside / "evil.safetensors")
    return outside / "evil.safetensors"


def _forge_file(step: Path, name: str, target: Path) -> None:
    data = target.read_bytes()
    _edit(step, lambda m: (_rename_shard(m, name),
                           m["files"].__setitem__(name, {"sha256": safe_io.sha256_hex(data), "bytes": len(data)})))


@pytest.mark.parametrize("name", ["../../outside/evil.safetensors", "ABSOLUTE", "/etc/passwd", "/dev/zero",
                                  "rank-00000.safetensors/..", ".."])
def test_a_file_name_reaching_outside_the_step_directory_is_damage(ckpt, capsys, name):
    evil = _outside_copy(ckpt)
    name = str(evil) if name == "ABSOLUTE" else name
    step = step_dir(ckpt, 4)
    target = evil if not name.startswith("/") or name == str(evil) else Path(name)
    if target.is_file() and os.access(target, os.R_OK):
        _forge_file(step, name, target)
    else:
        _edit(step, lambda m: _rename_shard(m, name))
    with pytest.raises(CheckpointDamaged) as error:
        read_tensors(step)
    text = _one_line(error.value, step)
    assert f"{step}/{MANIFEST}: a file name is" in text
    assert " bytes" not in text, "the message must not tell the size of a file outside"
    line = _resumed_falls_back_to_step_2(ckpt, capsys)
    assert "a file name is" in line
    assert cli.main(["export", str(step), "--to", str(ckpt.parent / "out.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0], err
    assert not (ckpt.parent / "out.safetensors").exists()


@pytest.mark.parametrize("kind", ["fifo", "symlink out", "symlink to /dev/zero", "directory"])
def test_a_shard_that_is_not_a_regular_file_is_refused_without_reading_it(ckpt, capsys, kind):
    step = step_dir(ckpt, 4)
    shard = step / SHARD
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "symlink out":
        shard.symlink_to(_outside_copy(ckpt))
    elif kind == "symlink to /dev/zero":
        shard.symlink_to("/dev/zero")
    else:
        shard.mkdir()
    start = time.monotonic()
    with pytest.raises(CheckpointDamaged) as error:
        read_tensors(step)
    assert time.monotonic() - start < 5
    text = _one_line(error.value, step)
    expect = {"fifo": "is a FIFO", "directory": "is a directory"}.get(kind, "leads outside")
    assert f"{shard} {expect}" in text
    _resumed_falls_back_to_step_2(ckpt, capsys)


def _pieces_manifest(shape: list[int], pieces: list[tuple[list[int], list[int]]]) -> dict:
    name = "model/w"
    return {
        "format": "trainmesh-checkpoint", "version": 2, "step": 0,
        "progress": {"step": 0, "skipped_steps": 0, "bad_steps_in_a_row": 0},
        "loss_scaler": {"scale": 1.0, "clean_steps": 0, "skipped_steps": 0},
        "model": {"n_layers": 1, "d_model": 1, "n_heads": 1, "d_ff": 1, "vocab_size": 1, "seq_len": 1},
        "config": {"model": "tiny"}, "layout": {"world_size": 1, "dp": 1, "tp": 1, "pp": 1, "zero": 0},
        "run": {"id": OTHER_RUN, "config_sha256": "0" * 64},
        "tensors": {name: {"shape": shape, "dtype": "float32", "pieces": [
            {"key": f"{name}@{','.join(map(str, o))}", "file": SHARD, "offsets": o, "sizes": s} for o, s in pieces]}},
        "files": {SHARD: {"sha256": "0" * 64, "bytes": 4 * math.prod(shape) + 10**6}}, "sha256": "0" * 64}


class TooMuchWork(AssertionError):
    """Validation ran more Python lines than a linear check could need."""


def _lines_to_check(manifest: dict, limit: int = 10**7) -> int:
    """How many Python lines checking ``manifest`` runs (``sys.settrace`` line events): a count of the work
    done that, unlike a wall time, does not depend on the machine or on what else runs on it. Past
    ``limit`` lines it stops with :class:`TooMuchWork`, so a quadratic check fails quickly instead of
    running for minutes under the tracer."""
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if lines > limit:
                raise TooMuchWork(f"checking took more than {limit} lines")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        check_manifest(manifest, "step-00000000")
        check_tiling(manifest)
    finally:
        sys.settrace(previous)
    return lines


def test_many_pieces_validate_in_linear_time():
    """4x the one-element pieces (in 1-D, and as a 2-D grid of twice the rows and columns) must cost at most
    5x the lines: a linear check costs 4x, the pairwise one that took 21 s for 4,000 pieces 16x."""
    for shape in ([1_000], [25, 40]):
        small, large = (_pieces_manifest(s, [(list(i), [1] * len(s)) for i in np.ndindex(*s)])
                        for s in (shape, [n * (4 if len(shape) == 1 else 2) for n in shape]))
        base = _lines_to_check(small)
        assert _lines_to_check(large, limit=5 * base) <= 5 * base
    overlapping = _pieces_manifest([2, 10], [([0, 0], [2, 5]), ([0, 5], [1, 5]), ([1, 4], [1, 5])])
    with pytest.raises(ManifestError, match="overlap"):
        _lines_to_check(overlapping)


def _set(path: str, value):
    def change(m: dict) -> None:
        *parents, last = path.split(".")
        node = m
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return change


def _first_piece(m: dict) -> dict:
    return m["tensors"]["model/blocks.0.attn.qkv.weight"]["pieces"][0]


MANIFEST_DAMAGE = {
    "negative step": (lambda m: (m.__setitem__("step", -3), m["progress"].__setitem__("step", -3)),
                      "step is -3; it must be an integer from 0"),
    "step of another directory": (lambda m: (m.__setitem__("step", 2), m["progress"].__setitem__("step", 2)),
                                  "step 2 is not the step of its directory step-00000004"),
    "string offsets": (lambda m: _first_piece(m).__setitem__("offsets", ["0", "0"]), "offsets is \"0\""),
    "float offsets": (lambda m: _first_piece(m).__setitem__("offsets", [0.0, 0.5]), "offsets is 0.0"),
    "missing key": (lambda m: m["tensors"]["model/head.weight"].pop("dtype"), "has keys missing [\"dtype\"]"),
    "missing progress": (lambda m: m.pop("progress"), "has keys missing [\"progress\"]"),
    "huge shape": (lambda m: (m["tensors"]["model/head.weight"].__setitem__("shape", [2**40, 2**20]),
                              m["tensors"]["model/head.weight"]["pieces"][0].__setitem__("sizes", [2**40, 2**20])),
                   "bytes but the file has"),
    "huge shape in a file claiming to hold it": (
        lambda m: (m["tensors"]["model/head.weight"].__setitem__("shape", [2**40, 2**3]),
                   m["tensors"]["model/head.weight"]["pieces"][0].__setitem__("sizes", [2**40, 2**3]),
                   m["files"][SHARD].__setitem__("bytes", 2**46)),
        f"bytes but was written with {2**46}"),
    "int64 dtype": (lambda m: m["tensors"]["model/head.weight"].__setitem__("dtype", "int64"),
                    "dtype \"int64\" is not one of"),
    "nan loss scale": (lambda m: m["loss_scaler"].__setitem__("scale", float("nan")), "loss_scaler.scale is NaN"),
    "pieces that leave a gap": (lambda m: _first_piece(m)["sizes"].__setitem__(0, 1), "do not add up"),
    "unknown tokenizer kind": (lambda m: m.__setitem__("tokenizer", {"kind": "sentencepiece"}),
                               "tokenizer.kind is \"sentencepiece\"; it must be one of bytes, file"),
    "tokenizer without its hash": (lambda m: m.__setitem__("tokenizer", {"kind": "file", "path": "tok.json"}),
                                   "tokenizer has keys missing [\"sha256\"]"),
    "tokenizer path over two lines": (lambda m: m.__setitem__("tokenizer", {"kind": "file", "path": "a\nb",
                                                                            "sha256": "0" * 64}),
                                      "tokenizer.path is \"a\\nb\""),
}


@pytest.mark.parametrize("case", list(MANIFEST_DAMAGE))
def test_a_manifest_outside_the_schema_is_one_line_and_falls_back(ckpt, capsys, case):
    change, message = MANIFEST_DAMAGE[case]
    step = step_dir(ckpt, 4)
    _edit(step, change)
    with pytest.raises(CheckpointDamaged) as error:
        read_tensors(step)
    assert message in _one_line(error.value, step)
    assert message in _resumed_falls_back_to_step_2(ckpt, capsys)


@pytest.mark.parametrize("value", [torch.zeros(5056, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8),
                                   torch.zeros(5056)], ids=["invalid state", "wrong size", "float"])
def test_a_replaced_generator_state_is_damage(ckpt, capsys, value):
    step = step_dir(ckpt, 4)
    _replace_tensor(step, "rng/0/cpu@0", value)
    line = _resumed_falls_back_to_step_2(ckpt, capsys)
    assert f"{step}/" in line
    assert "rng/0/cpu" in line


# --- run identity --------------------------------------------------------------------------------------

def test_a_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(ckpt, capsys):
    owner = read_manifest(step_dir(ckpt, 4))["run"]["id"]
    with pytest.raises(CheckpointError, match=f"holds checkpoints of another run .step-00000004 and 1 more, run "
                                              f"{owner}.; pass --resume .* --overwrite"):
        with checkpoints.claim(_cfg(ckpt)):
            pass
    with pytest.raises(CheckpointError, match="holds checkpoints of another run"):
        checkpoints.restore(build(_cfg(ckpt), _mesh()))
    code = cli.main(["train", "--steps", "2", "--global-batch", "4", "--checkpoint-dir", str(ckpt),
                     "--out", str(ckpt.parent / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds checkpoints of another run" in err[0], err
    assert {p.name for p in ckpt.iterdir()} == {"latest", LOCK, "step-00000002", "step-00000004"}


def test_overwrite_deletes_the_other_runs_checkpoints_before_the_fresh_run(ckpt):
    old = read_manifest(step_dir(ckpt, 4))["run"]["id"]
    (ckpt / ".tmp-step-00000006").mkdir()
    result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--steps", "2", "--global-batch", "4",
                             "--warmup-steps", "1", "--checkpoint-dir", str(ckpt), "--overwrite", "--no-progress",
                             "--out", str(ckpt.parent / "run")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in ckpt.iterdir()} == {"latest", LOCK, "step-00000002"}
    new = read_manifest(step_dir(ckpt, 2))["run"]
    assert new["id"] != old and len(new["config_sha256"]) == 64
    assert json.loads((ckpt / LOCK).read_text())["run_id"] == new["id"]


def test_resume_continues_the_run_id_and_never_falls_back_to_another_run(ckpt, capsys):
    owner = read_manifest(step_dir(ckpt, 4))["run"]["id"]
    run = build(_cfg(ckpt, resume=True, steps=6), _mesh())
    progress = checkpoints.restore(run)
    assert (progress.step, progress.run_id) == (4, owner)
    with checkpoints.claim(_cfg(ckpt, resume=True, steps=6)) as claimed:
        assert claimed == owner == os.environ[RUN_ID_ENV]
    # the case: step 2 (the latest) belongs to this run and is damaged; step 4 is another run's
    (ckpt / "latest").write_text("step-00000002\n")
    _edit(step_dir(ckpt, 4), _set("run.id", OTHER_RUN))
    (ckpt / LOCK).unlink()
    (step_dir(ckpt, 2) / SHARD).write_bytes(b"damaged")
    capsys.readouterr()
    with pytest.raises(CheckpointError) as error:
        checkpoints.restore(build(_cfg(ckpt, resume=True, steps=6), _mesh()))
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"no sound checkpoint of run {owner} in {ckpt}")
    assert f"checkpoint {step_dir(ckpt, 4)} belongs to run {OTHER_RUN}, not to run {owner}" in text


def test_a_second_live_run_on_the_directory_is_refused_naming_the_first_ones_pid(ckpt):
    with checkpoints.claim(_cfg(ckpt, resume=True)):
        with pytest.raises(CheckpointError, match=f"is in use by another live run .pid {os.getpid()}, run "):
            with checkpoints.claim(_cfg(ckpt, resume=True)):
                pass
        result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--resume", "--steps", "6",
                                 "--global-batch", "4", "--checkpoint-dir", str(ckpt), "--out",
                                 str(ckpt.parent / "run")], capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"is in use by another live run (pid {os.getpid()}" in lines[0]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_of_a_dead_process_is_taken_over(ckpt):
    (ckpt / LOCK).write_text(json.dumps({"pid": _dead_pid(), "run_id": OTHER_RUN}))
    with checkpoints.claim(_cfg(ckpt, resume=True)) as run_id:
        assert run_id == OTHER_RUN, "the lock file's record names the run to continue"
    # held by a descriptor that outlived its process (the pid in the file is dead): replaced
    fd = os.open(ckpt / LOCK, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, json.dumps({"pid": _dead_pid()}).encode().ljust(200), 0)
    try:
        with checkpoints.claim(_cfg(ckpt, resume=True)):
            assert json.loads((ckpt / LOCK).read_text())["pid"] == os.getpid()
    finally:
        os.close(fd)


# --- retention: --keep-last counts only sound checkpoints of its own names (issue 46) --------------------

def _tiny_saves(root: Path, steps: list[int]) -> tuple:
    """``tm.save`` of a tiny model at each of ``steps`` into ``root``; the model and optimizer."""
    import trainmesh as tm

    torch.manual_seed(0)
    model = tm.parallelize(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)), _mesh())
    opt = tm.optimizer(model, lr=1e-2)
    for step in steps:
        tm.save(model, opt, root, step=step)
    return model, opt


def test_keep_last_never_prunes_a_sound_checkpoint_to_keep_a_damaged_one(tmp_path, capsys):
    """Case 6: sound step-4 and step-6, step-7 with a truncated shard, ``--keep-last 2`` publishing step-8:
    step-6 stays (the damaged step-7 does not count), step-4 goes."""
    import trainmesh as tm

    model, opt = _tiny_saves(tmp_path, [4, 6, 7])
    shard = step_dir(tmp_path, 7) / SHARD
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    tm.save(model, opt, tmp_path, step=8, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000007", "step-00000008"]
    assert "; deleted step-00000004 (--keep-last 2)" in capsys.readouterr().err
    tm.save(model, opt, tmp_path, step=9, keep_last=2)  # older than the oldest kept sound one: the damaged one goes
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000008", "step-00000009"]


def test_keep_last_neither_counts_nor_deletes_names_that_are_not_its_own(tmp_path, capsys):
    """Case 6's second half: a ``step-00000009`` link (to a sound step), a ``step-50`` link and a misnamed
    ``step-000000003`` directory beside sound step-2 and step-8; publishing step-10 with ``--keep-last 2``
    keeps step-8 and deletes only step-2, and the planted names stay as they were."""
    import trainmesh as tm

    model, opt = _tiny_saves(tmp_path / "elsewhere", [9])
    _tiny_saves(tmp_path / "ckpt", [2, 8])
    root = tmp_path / "ckpt"
    (root / "step-00000009").symlink_to(step_dir(tmp_path / "elsewhere", 9))
    (root / "step-50").symlink_to(step_dir(root, 8))
    (root / "step-000000003").mkdir()
    tm.save(model, opt, root, step=10, keep_last=2)
    assert {p.name for p in root.glob("step-*")} == {"step-000000003", "step-00000008", "step-00000009",
                                                     "step-00000010", "step-50"}
    assert (step_dir(tmp_path / "elsewhere", 9) / MANIFEST).is_file()
    assert "deleted step-00000002 (--keep-last 2)" in capsys.readouterr().err


# --- the fuzzer ----------------------------------------------------------------------------------------

HOSTILE = [None, True, False, -1, 0, 1, 3, 2**31, 2**63, 10**30, -3, 1.5, float("nan"), float("inf"), "", "x",
           "../../outside/evil.safetensors", "/etc/passwd", "/dev/zero", "a\nb", "int64", "float16", "uint8",
           "rank-00009.safetensors", [], [0], [-1], [1, 1], [2**40], ["0"], {}, {"a": 1}, [[1]]]
PLANTED = {"rank-00009.safetensors": "fifo", "rank-00008.safetensors": "link out",
           "rank-00007.safetensors": "link /dev/zero", "rank-00006.safetensors": "dir"}


def _mutate_json(rng: random.Random, doc, names: list[str]) -> str:
    """One random mutation of ``doc`` in place; returns what it did."""
    container, key = rng.choice(json_nodes(doc))
    how = rng.random()
    if how < 0.45:
        container[key] = rng.choice(HOSTILE)
    elif how < 0.6:
        old = container[key]
        if type(old) is int:
            container[key] = old + rng.choice([-1, 1, -(old + 1), 2**20])
        else:
            container[key] = rng.choice(HOSTILE)
    elif how < 0.75:
        del container[key]
    elif how < 0.85 and isinstance(container, dict):
        container[rng.choice(["extra", "a\nb", "../x"])] = rng.choice(HOSTILE)
    elif how < 0.95 and isinstance(container, dict) and names:
        new = rng.choice(names)
        container[new] = container.pop(key)
        key = f"{key!r}->{new!r}"
    else:
        container[key] = json.loads(json.dumps(rng.choice(list(container.values())
                                                          if isinstance(container, dict) else container)))
    return f"{how:.2f} at {key!r}"


def _mutate_manifest(rng: random.Random, text: str) -> tuple[bytes, str]:
    if rng.random() < 0.1:  # raw bytes: a flipped bit, a cut, a duplicated span
        data = bytearray(text.encode())
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        return bytes(data) if rng.random() < 0.5 else bytes(data[:i]), "raw"
    manifest = json.loads(text)
    if rng.random() < 0.3:
        name = rng.choice([*PLANTED, "../../outside/evil.safetensors", "/dev/zero", "..", "", "rank-1.safetensors"])
        _rename_shard(manifest, name)
        what = f"file name {name!r}"
    else:
        what = _mutate_json(rng, manifest, list(PLANTED))
    if rng.random() < 0.9:
        manifest["sha256"] = checkpoint.store.content_hash(manifest)
    return json.dumps(manifest).encode(), what


def _mutate_header(rng: random.Random, shard: bytes) -> tuple[bytes, str]:
    n = struct.unpack("<Q", shard[:8])[0]
    header, body = shard[8:8 + n], shard[8 + n:]
    if rng.random() < 0.25:
        data = bytearray(header)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return shard[:8] + bytes(data) + body, "header bit"
    if rng.random() < 0.1:
        return struct.pack("<Q", rng.choice([0, n - 1, n + 1, 2**40, 2**64 - 1])) + shard[8:], "header length"
    doc = json.loads(header)
    what = _mutate_json(rng, doc, [])
    new = json.dumps(doc).encode()
    return struct.pack("<Q", len(new)) + new + body, what


def _plant(step: Path, outside: Path) -> None:
    for name, kind in PLANTED.items():
        path = step / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link out":
            path.symlink_to(outside)
        elif kind == "link /dev/zero":
            path.symlink_to("/dev/zero")
        else:
            path.mkdir()


OPENED: list | None = None


def _audit(event: str, args) -> None:
    if OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


def _snapshot(run) -> list[torch.Tensor]:
    return [t.views[0].detach().clone() for t in checkpoint.store.local_state(run.model, run.engine)]


@pytest.mark.timeout(300)
def test_fuzzed_manifests_names_and_headers_load_equal_or_fail_in_one_line(ckpt):
    """1,300 mutants of step 4 (manifest values, keys and raw bytes; file names, also of planted FIFOs and
    links; safetensors headers with the manifest re-hashed to match): each loads equal to the original, or
    fails with one line naming the checkpoint and a file in it; none opens a file outside it or hangs."""
    global OPENED
    step = step_dir(ckpt, 4)
    outside = _outside_copy(ckpt)
    _plant(step, outside)
    run = build(_cfg(ckpt, resume=True, steps=6), _mesh())
    fits = functools.partial(checkpoints.check_fits, run)  # what --resume asks of a checkpoint
    api.load(run.parallel, run.opt, step, accept=fits)
    original, original_rng = _snapshot(run), torch.get_rng_state()
    text, shard = (step / MANIFEST).read_text(), (step / SHARD).read_bytes()
    sys.addaudithook(_audit)
    rng = random.Random(15)
    outcomes = {"equal": 0, "refused": 0}
    start = time.monotonic()
    for case in range(1300):
        if case % 4 == 3:
            data, what = _mutate_header(rng, shard)
            (step / SHARD).write_bytes(data)
            manifest = json.loads(text)
            manifest["files"][SHARD] = {"sha256": safe_io.sha256_hex(data), "bytes": len(data)}
            manifest["sha256"] = checkpoint.store.content_hash(manifest)
            (step / MANIFEST).write_text(json.dumps(manifest))
        else:
            data, what = _mutate_manifest(rng, text)
            (step / MANIFEST).write_bytes(data)
        OPENED = []
        label = f"case {case} ({'header' if case % 4 == 3 else 'manifest'} {what})"
        try:
            with deadline(5):
                api.load(run.parallel, run.opt, step, accept=fits)
                manifest = read_manifest(step)
        except CaseTimeout:
            pytest.fail(f"{label} hung")
        except CheckpointError as e:
            message = str(e)
            names_a_file = f"{step}/" in message or isinstance(e, CheckpointMismatch) and str(step) in message
            assert "\n" not in message and names_a_file, f"{label}: {message!r}"
            outcomes["refused"] += 1
        else:
            assert all(torch.equal(a, b) for a, b in zip(_snapshot(run), original)), f"{label} loaded other data"
            if manifest["layout"]["world_size"] == 1:
                assert torch.equal(torch.get_rng_state(), original_rng), label
            progress = manifest["progress"]
            assert 0 <= progress["bad_steps_in_a_row"] <= progress["skipped_steps"] <= progress["step"], label
            outcomes["equal"] += 1
        finally:
            opened, OPENED = OPENED, None
        strays = [p for p in opened if not p.endswith((".py", ".pyc", ".so")) and Path(p).parent != step]
        assert not strays, f"{label} opened {strays}"
        if case % 4 == 3:
            (step / SHARD).write_bytes(shard)
        (step / MANIFEST).write_text(text)
    elapsed = time.monotonic() - start
    print(f"fuzzer: {outcomes} in {elapsed:.1f} s")
    assert outcomes["refused"] > 1000 and outcomes["equal"] > 10, outcomes
