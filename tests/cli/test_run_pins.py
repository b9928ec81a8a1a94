"""Runs and checkpoints that cannot be swapped or overwritten underneath (issue 33): step numbers of any
width, checkpoints that lack a tensor of their model, retention (``--keep-last``), a finished run's folder,
TensorBoard on a full disk, symbolic links planted in a run folder, and the tokenizer pinned by content."""

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import trainmesh as tm
from trainmesh import checkpoint
from trainmesh.app import checkpoints as app_checkpoints
from trainmesh.app import cli
from trainmesh.app.config import Config
from trainmesh.app.train import train
from trainmesh.checkpoint import CheckpointError
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import spec_of
from trainmesh.tracking.records import MetricsError, MetricsWriter, TensorBoardSink

from helpers import PAGE, fill_disk, small_disk, word_tokenizer
from runs import config


def _mesh() -> Mesh:
    return Mesh.build(1, 1, 1, torch.device("cpu"))


def _tiny() -> tuple[tm.ParallelModel, tm.Optimizer]:
    torch.manual_seed(0)
    model = tm.parallelize(nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)).double(), _mesh(), precision="fp64")
    return model, tm.optimizer(model, lr=1e-2)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 16, (2, 9), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def test_a_step_past_99999999_is_found_as_the_newest(tmp_path):
    """Step directories sort by number: ``step-100000000`` (nine digits) is newer than ``step-00000005``,
    also with no ``latest`` pointer to say so."""
    model, opt = _tiny()
    tm.save(model, opt, tmp_path, step=5)
    tm.train_step(model, opt, _batch())
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert tm.save(model, opt, tmp_path, step=100_000_000).name == "step-100000000"
    (tmp_path / checkpoint.LATEST).unlink()
    fresh, fresh_opt = _tiny()
    assert tm.load(fresh, fresh_opt, tmp_path) == 100_000_000
    assert all(torch.equal(v, trained[k]) for k, v in fresh.state_dict().items())


def _cfg(root: Path, **kw) -> Config:
    return config(**{"steps": 2, "global_batch": 4, "warmup_steps": 1, "checkpoint_every": 1,
                     "checkpoint_dir": str(root / "ckpt"), "out": str(root / "run"), "tensorboard": False, **kw})


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A finished single-process run of two steps: its run folder ``run`` and checkpoints ``ckpt`` of both."""
    root = tmp_path_factory.mktemp("pins")
    train(_cfg(root), _mesh())
    return root


@pytest.fixture
def copied(saved, tmp_path) -> Path:
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    return tmp_path


def _edit(step: Path, change) -> None:
    """Apply ``change`` to the manifest of ``step`` and re-hash it, as someone with write access could."""
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    change(manifest)
    manifest["sha256"] = checkpoint.store.content_hash(manifest)
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def _drop_head(manifest: dict) -> None:
    for name in [n for n in manifest["tensors"] if n.startswith(("model/head.", "optim/head."))]:
        del manifest["tensors"][name]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_checkpoint_lacking_a_weight_is_neither_exported_nor_loaded(copied, capsys):
    """A manifest without ``model/head.weight`` (re-hashed): ``export --to`` and ``--hf`` exit 2 naming it
    and write nothing; ``tm.load`` raises naming it; ``--resume`` skips it naming it; ``--init-from`` a file
    without it is refused naming it."""
    ckpt, step = copied / "ckpt", copied / "ckpt" / "step-00000002"
    _edit(step, _drop_head)
    to, hf_dir = copied / "w.safetensors", copied / "hf"
    for argv in (["export", str(step), "--to", str(to)], ["export", str(step), "--hf", str(hf_dir)]):
        assert cli.main(argv) == 2
        assert "model/head.weight" in _error_line(capsys)
    assert not to.exists() and not hf_dir.exists()

    cfg = _cfg(copied)
    model = tm.parallelize(spec_of(cfg.model.model).builder(cfg.model_config, 0), _mesh())
    with pytest.raises(CheckpointError, match=r"model/head.weight is missing there"):
        tm.load(model, tm.optimizer(model), step)

    train(_cfg(copied, steps=3, resume=True), _mesh())
    err = capsys.readouterr().err
    assert f"checkpoint {step} is damaged" in err and "model/head.weight is missing" in err
    assert "resumed from" in err and "step-00000001" in err

    assert cli.main(["export", str(ckpt / "step-00000001"), "--to", str(to)]) == 0
    weights = safetensors.torch.load_file(to)
    del weights["head.weight"]
    safetensors.torch.save_file(weights, to)
    with pytest.raises(CheckpointError, match=rf"--init-from {to} lacks head.weight, a weight of --model tiny"):
        train(_cfg(copied / "again", init_from=str(to)), _mesh())


def _events(path: Path) -> list:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return list(EventFileLoader(str(path)).Load())


def test_tensorboard_on_a_full_disk_is_one_line_and_its_file_keeps_whole_records(tmp_path, capfd):
    """TensorBoard events meet a full disk: :class:`MetricsError` names them and the errno (what stops the
    run, as for ``metrics.jsonl``), no thread prints a traceback, and the event file and the metrics file
    hold only whole records. (Records with 64 ranks' memory make TensorBoard's share the larger one.)"""
    pytest.importorskip("tensorboard")
    with small_disk(tmp_path / "disk", 64 * PAGE) as disk:
        run = disk / "run"
        writer = MetricsWriter(str(run), enabled=True, sinks=[TensorBoardSink(run)])
        record = {"loss": 1.0, "max_rss_bytes": list(range(1, 65))}
        writer.write({"step": 1, **record})
        fill_disk(disk, 0)
        with pytest.raises(MetricsError, match=rf"writing TensorBoard events in {run} failed: \[Errno "
                                               rf"{errno.ENOSPC}\]") as failed:
            for step in range(2, 1000):
                writer.write({"step": step, **record})
        writer.close()
        assert len(str(failed.value).splitlines()) == 1
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, step + 1))
        logged = {e.step for e in _events(next(run.glob("events.out.tfevents.*"))) if e.HasField("summary")}
        assert logged == set(range(1, step))
    assert capfd.readouterr().err == ""


def test_a_run_whose_out_fills_stops_in_one_line_after_a_final_checkpoint(tmp_path):
    """TensorBoard on (the default) and ``--out`` on a disk that fills mid-run: one line naming the file
    that could not be written, and the checkpoint of the last step done is saved (elsewhere)."""
    pytest.importorskip("tensorboard")
    with small_disk(tmp_path / "disk", 64 * PAGE) as disk:
        (disk / "run").mkdir()
        fill_disk(disk, 3)
        cfg = _cfg(tmp_path, steps=40, checkpoint_every=0, out=str(disk / "run"), tensorboard=True)
        with pytest.raises(MetricsError) as failed:
            train(cfg, _mesh())
    message = str(failed.value)
    assert len(message.splitlines()) == 1 and f"[Errno {errno.ENOSPC}]" in message
    done = int(message.split("stopped after step ")[1].split(";")[0])
    assert f"{tmp_path / 'ckpt' / f'step-{done:08d}'} holds step {done}" in message
    assert (tmp_path / "ckpt" / f"step-{done:08d}" / checkpoint.MANIFEST).is_file()


def _train_argv(root: Path, *extra: str) -> list[str]:
    return ["train", "--steps", "2", "--global-batch", "4", "--no-progress", "--out", str(root / "run"),
            "--checkpoint-dir", str(root / "ckpt2"), *extra]


def test_a_finished_runs_folder_is_refused_unless_overwrite(copied, capsys, monkeypatch):
    """``train --out X`` where X holds a finished run: refused in one line with the ways out, and X is as
    it was; with ``--overwrite`` its records are deleted before the new run starts."""
    run = copied / "run"
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert cli.main(_train_argv(copied)) == 2
    err = _error_line(capsys)
    assert (f"--out {run} holds the records of another run (metrics.jsonl, summary.json); pass --overwrite to "
            f"replace them, --resume to continue that run, or choose another --out") in err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    monkeypatch.setattr(cli, "_train_here", lambda cfg: 0)
    assert cli.main(["train", "--steps", "2", "--global-batch", "4", "--out", str(run), "--overwrite"]) == 0
    assert not (run / "metrics.jsonl").exists() and not (run / "summary.json").exists()


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json", "report.png", ".trainmesh.lock",
                                  "events.out.tfevents.1.host.1.1"])
def test_a_link_planted_in_a_run_folder_is_refused_and_its_target_never_written(tmp_path, capsys, name):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).symlink_to(victim)
    assert cli.main(_train_argv(tmp_path, "--overwrite")) == 2
    assert f"{tmp_path / 'run' / name} is a symbolic link (to {victim})" in _error_line(capsys)
    assert victim.read_text() == "precious"


def test_run_files_are_never_written_through_a_link_planted_after_the_check(tmp_path, saved):
    """The writers themselves open without following links: ``metrics.jsonl`` (fresh and resumed) is
    refused naming it, ``report`` refuses a linked ``report.png``; the target stays as it was."""
    from trainmesh.tracking.report import ReportError, report

    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    for resume_from in (None, 1):
        with pytest.raises(MetricsError, match=f"opening {run / 'metrics.jsonl'} failed: .*symbolic link"):
            MetricsWriter(str(run), enabled=True, resume_from=resume_from)
    shutil.copytree(saved / "run", tmp_path / "done")
    (tmp_path / "done" / "report.png").symlink_to(victim)
    with pytest.raises(ReportError, match=f"{tmp_path / 'done' / 'report.png'} is a symbolic link"):
        report(tmp_path / "done")
    assert victim.read_text() == "precious"


def test_a_planted_staging_link_is_removed_without_following_it(tmp_path):
    """A ``.tmp-step-N`` link (a leftover's name, only trainmesh stages there) is unlinked before the save
    stages its files; the directory it led to is untouched and the save succeeds."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("precious")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / ".tmp-step-00000001").symlink_to(elsewhere)
    model, opt = _tiny()
    assert tm.save(model, opt, root, step=1) == root / "step-00000001"
    assert [p.name for p in elsewhere.iterdir()] == ["keep"] and (elsewhere / "keep").read_text() == "precious"
    assert not (root / ".tmp-step-00000001").exists()


def test_keep_last_leaves_the_newest_checkpoints_and_latest_on_the_last(tmp_path, capsys):
    """``--checkpoint-every 1`` over 6 steps with ``--keep-last 2``: step-5 and step-6 are left, ``latest``
    names step-6, and each deletion is said."""
    train(_cfg(tmp_path, steps=6, keep_last=2), _mesh())
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(("step-", ".")) and p.name != checkpoint.LOCK) \
        == ["step-00000005", "step-00000006"]
    assert (root / checkpoint.LATEST).read_text().strip() == "step-00000006"
    assert "deleted step-00000004 (--keep-last 2)" in capsys.readouterr().err


def test_keep_last_in_the_api_counts_back_from_the_saved_step_and_spares_newer_ones(tmp_path):
    model, opt = _tiny()
    for step in (1, 2, 3):
        tm.save(model, opt, tmp_path, step=step)
    (tmp_path / checkpoint.LATEST).write_text("step-00000001\n")
    tm.save(model, opt, tmp_path, step=4, keep_last=1)  # publishing step-4 moves latest to it
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004"]
    tm.save(model, opt, tmp_path, step=3, keep_last=1)  # an older step: step-4 is newer, so it stays
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]


def test_a_disk_that_holds_keep_last_plus_one_checkpoints_but_not_all_finishes(tmp_path, capsys):
    """Six checkpoints would not fit the checkpoint disk; three (``--keep-last 2`` and the one being
    written) do: the pre-flight check passes and the run finishes with the last two."""
    from trainmesh.app.rundir import checkpoints_at_once, checkpoint_bytes

    cfg = _cfg(tmp_path, steps=6, keep_last=2)
    one = checkpoint_bytes(cfg)
    assert checkpoints_at_once(cfg) == 3
    with small_disk(tmp_path / "ckdisk", 4 * one) as disk:
        cfg = _cfg(tmp_path, steps=6, keep_last=2, checkpoint_dir=str(disk))
        assert cli.main(_train_argv(tmp_path, "--steps", "6", "--checkpoint-every", "1", "--keep-last", "0",
                                    "--checkpoint-dir", str(disk))) == 2
        assert "the 6 checkpoints it holds at once" in _error_line(capsys)
        train(cfg, _mesh())
        assert sorted(p.name for p in disk.glob("step-*")) == ["step-00000005", "step-00000006"]


# --- the tokenizer, pinned by content -------------------------------------------------------------------

WORDS = ["def", "return", "self", "import", "(", ")", ":", "x", "<|endoftext|>"]


@pytest.fixture
def two_tokenizers(tmp_path) -> tuple[Path, Path]:
    """The run's tokenizer and another one of the same vocabulary size."""
    return (word_tokenizer(tmp_path / "tok.json", WORDS),
            word_tokenizer(tmp_path / "other.json", [w.replace("self", "class") for w in WORDS]))


def _corpus(root: Path) -> Path:
    root.mkdir()
    for i in range(40):
        (root / f"{i}.txt").write_text("def f ( x ) : return self . x\nimport x\n" * (i % 3 + 1))
    return root


def _pin12(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def test_prepared_data_keeps_its_tokenizer_and_refuses_another_before_training(tmp_path, two_tokenizers, capsys):
    """``prepare`` keeps a copy of its tokenizer beside the shards and the index names only that: the
    original deleted afterwards, the run trains and its checkpoint keeps the same bytes; another tokenizer of
    the same size as ``--tokenizer``, or the data's copy replaced by it, is one line before training naming
    both files and both hashes' first 12 hex digits."""
    from trainmesh.data.prepare import PrepareOptions, prepare

    tok, other = two_tokenizers
    data = tmp_path / "data"
    prepare(PrepareOptions((str(_corpus(tmp_path / "docs")),), str(tok), str(data), 1, 1 << 20, 0.2),
            stream=open(os.devnull, "w"))
    original = tok.read_bytes()
    tok.unlink()
    train(_cfg(tmp_path, data=str(data), seq_len=8), _mesh())
    assert (tmp_path / "ckpt" / "step-00000002" / "tokenizer.json").read_bytes() == original
    capsys.readouterr()

    argv = ["train", "--data", str(data), "--seq-len", "8", "--steps", "2", "--global-batch", "4", "--no-progress",
            "--out", str(tmp_path / "again")]
    assert cli.main([*argv, "--tokenizer", str(other)]) == 2
    err = _error_line(capsys)
    assert f"tokenizer {other} (SHA-256 {_pin12(other)}) is not the one {data} was prepared with" in err
    assert f"({data / 'tokenizer.json'}, SHA-256 {_pin12(data / 'tokenizer.json')})" in err
    shutil.copy(other, data / "tokenizer.json")
    assert cli.main(argv) == 2
    assert f"tokenizer {data / 'tokenizer.json'} (SHA-256 {_pin12(other)}) has changed since {data} was prepared" \
        in _error_line(capsys)
    assert not (tmp_path / "again" / "metrics.jsonl").exists()


def test_resume_with_another_tokenizer_of_the_same_size_is_refused_before_training(tmp_path, two_tokenizers,
                                                                                    capsys, monkeypatch):
    """Text data with ``--tokenizer``: the checkpoint pins it; ``--resume --tokenizer other.json`` (the same
    vocabulary) is one line naming both and the copy the checkpoint keeps; the original changed under the run
    between saves is said and the checkpoint keeps the bytes the run started with."""
    tok, other = two_tokenizers
    docs = _corpus(tmp_path / "docs")
    train(_cfg(tmp_path, data=str(docs), tokenizer=str(tok), seq_len=8), _mesh())
    step = tmp_path / "ckpt" / "step-00000002"
    capsys.readouterr()
    argv = ["train", "--data", str(docs), "--seq-len", "8", "--steps", "3", "--global-batch", "4", "--no-progress",
            "--out", str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume"]
    assert cli.main([*argv, "--tokenizer", str(other)]) == 2
    err = _error_line(capsys)
    assert (f"checkpoint {step} was trained with tokenizer {tok} (SHA-256 {_pin12(tok)}), and this run has "
            f"tokenizer {other} (SHA-256 {_pin12(other)}); pass the tokenizer it was trained with (the checkpoint "
            f"keeps a copy: --tokenizer {step / 'tokenizer.json'})") in err
    with pytest.raises(CheckpointError, match="was trained with tokenizer"):
        train(_cfg(tmp_path, data=str(docs), tokenizer=str(other), seq_len=8, steps=3, resume=True), _mesh())

    pinned = tok.read_bytes()
    real_restore = app_checkpoints.restore

    def restore_then_swap(run, keeper=None):
        progress = real_restore(run, keeper)
        shutil.copy(other, tok)  # the file changes under the running run
        return progress

    monkeypatch.setattr(app_checkpoints, "restore", restore_then_swap)
    train(_cfg(tmp_path, data=str(docs), tokenizer=str(tok), seq_len=8, steps=3, resume=True), _mesh())
    assert f"tokenizer {tok} is now SHA-256 {_pin12(other)}, not the" in capsys.readouterr().err
    assert (tmp_path / "ckpt" / "step-00000003" / "tokenizer.json").read_bytes() == pinned


def test_resume_alone_continues_a_preset_run_whose_tokenizer_reshaped_its_model(tmp_path, two_tokenizers):
    """``--resume`` without ``--model`` on a ``tiny`` run trained with a tokenizer (its vocabulary padded, so
    its config is not the preset's): the preset and the recorded tokenizer rebuild the model."""
    tok, _ = two_tokenizers
    docs = _corpus(tmp_path / "docs")
    train(_cfg(tmp_path, data=str(docs), tokenizer=str(tok), seq_len=8), _mesh())
    assert cli.main(["train", "--data", str(docs), "--seq-len", "8", "--steps", "3", "--global-batch", "4",
                     "--no-progress", "--no-tensorboard", "--out", str(tmp_path / "run"), "--checkpoint-dir",
                     str(tmp_path / "ckpt"), "--resume"]) == 0
    assert (tmp_path / "ckpt" / "step-00000003").is_dir()


OPENED: list[str] | None = None


def _audit(event: str, args) -> None:
    if OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def _opened() -> list[str]:
    global OPENED
    OPENED = []
    try:
        yield OPENED
    finally:
        OPENED = None


@pytest.mark.parametrize("record", [{"kind": "file", "path": "SECRET"}, {"kind": "file", "path": "../../secret"},
                                    {"kind": "copy", "source": "SECRET", "link": True}])
def test_a_tokenizer_path_in_a_manifest_is_never_read(copied, record, capsys):
    """A re-hashed manifest whose tokenizer names a file outside the step directory (absolute, ``../..``, or
    the kept copy replaced by a link to it): ``generate`` is one line, the file is never opened, and no hash
    of it is shown."""
    secret = copied / "secret"
    secret.write_text("root:$6$hash")
    step = copied / "ckpt" / "step-00000002"
    record = {k: str(secret) if v == "SECRET" else v for k, v in record.items()}
    if record.pop("link", False):
        (step / "tokenizer.json").symlink_to(secret)
    digest = "ab" * 32
    _edit(step, lambda m: m.update(tokenizer={**record, "sha256": digest, **({"bytes": secret.stat().st_size}
                                                                               if record["kind"] == "copy" else {})}))
    with _opened() as opened:
        assert cli.main(["generate", "--checkpoint-dir", str(step), "--prompt", "def", "--max-new-tokens", "2"]) == 2
    err = _error_line(capsys)
    assert str(secret) not in {str(Path(p).resolve()) for p in opened}
    assert ("is not read; pass that tokenizer" in err) or ("symbolic link" in err and "damaged" in err)
    assert _pin12(secret) not in err


@pytest.mark.parametrize("name", ["SECRET", "../secret", "../../x"])
def test_a_tokenizer_path_in_a_data_index_outside_the_data_is_never_read(tmp_path, two_tokenizers, capsys, name):
    from trainmesh.data.prepare import PrepareOptions, prepare

    secret = tmp_path / "secret"
    secret.write_text("root:$6$hash")
    data = tmp_path / "data"
    prepare(PrepareOptions((str(_corpus(tmp_path / "docs")),), str(two_tokenizers[0]), str(data), 1, 1 << 20, 0.2),
            stream=open(os.devnull, "w"))
    index = json.loads((data / "index.json").read_text())
    index["tokenizer"]["path"] = str(secret) if name == "SECRET" else name
    (data / "index.json").write_text(json.dumps(index))
    with _opened() as opened:
        assert cli.main(["train", "--data", str(data), "--seq-len", "8", "--steps", "2", "--no-progress",
                         "--out", str(tmp_path / "run")]) == 2
    assert str(secret) not in {str(Path(p).resolve()) for p in opened}
    assert "it is not read: pass the tokenizer" in _error_line(capsys)
