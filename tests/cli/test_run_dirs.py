"""The directories a run writes: checked before any rank starts, never shared by two live runs, and a
metrics file that holds only whole lines and stops the run when it cannot be written."""

import errno
import fcntl
import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from trainmesh.app import cli, rundir
from trainmesh.distributed import launcher
from trainmesh.tracking import runlock
from trainmesh.tracking import records as metrics_module
from trainmesh.app.config import Config, ConfigError
from trainmesh.tracking.records import MetricsError, MetricsWriter

from helpers import PAGE, fill_disk, small_disk


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a rank was spawned although the run's directories are unusable")

    monkeypatch.setattr(launcher, "launch", refuse)


def one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_checkpoint_dir_under_a_regular_file_is_refused_before_spawn(tmp_path, capsys, no_spawn):
    (tmp_path / "afile").write_text("x")
    err = one_line_error(capsys, ["train", "--nproc", "2", "--dp", "2", "--out", str(tmp_path / "run"),
                                  "--checkpoint-dir", str(tmp_path / "afile" / "ck")])
    assert f"--checkpoint-dir {tmp_path}/afile/ck lies under {tmp_path}/afile, which is a file" in err


def test_out_naming_an_existing_file_is_refused(tmp_path, capsys, no_spawn):
    (tmp_path / "run").write_text("x")
    err = one_line_error(capsys, ["train", "--nproc", "2", "--dp", "2", "--out", str(tmp_path / "run")])
    assert f"--out {tmp_path}/run is a file, not a directory" in err


def test_unwritable_out_is_refused(tmp_path, monkeypatch):
    def denied(path, *_a):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(rundir.os, "open", denied)  # as a read-only directory does, even for root
    with pytest.raises(ConfigError, match=f"^--out {tmp_path} is not writable \\(Permission denied\\); choose"):
        rundir.ensure_writable(tmp_path, "--out")


def test_probe_leaves_nothing_behind(tmp_path):
    rundir.ensure_writable(tmp_path / "a" / "b", "--out")
    assert list((tmp_path / "a" / "b").iterdir()) == []


def test_too_little_space_for_one_checkpoint_is_refused(tmp_path, monkeypatch, capsys, no_spawn):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda _p: usage(10**9, 10**9 - 4096, 4096))
    need = rundir.checkpoint_bytes(Config())
    assert need == Config().model_config.n_params() * (4 + 8)  # fp32 parameters + Adam's two moments
    err = one_line_error(capsys, ["train", "--nproc", "2", "--dp", "2", "--out", str(tmp_path / "run"),
                                  "--checkpoint-dir", str(tmp_path / "ck")])
    assert f"has 0.0 MiB free but one checkpoint needs about {need / 2**20:.1f} MiB" in err


def test_default_run_dirs_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dirs = [rundir.default_out_dir() for _ in range(50)]
    assert len(set(dirs)) == 50 and all(Path(d).is_dir() for d in dirs)


def test_a_live_run_holds_its_out_dir(tmp_path, capsys, no_spawn):
    out = tmp_path / "run"
    out.mkdir()
    with runlock.hold(out, "--out"):
        err = one_line_error(capsys, ["train", "--nproc", "2", "--dp", "2", "--out", str(out)])
    assert f"--out {out} is in use by another run (pid {os.getpid()} on" in err
    assert "choose another --out" in err
    with runlock.hold(out, "--out"):  # released: the next run gets it
        pass
    assert not (out / runlock.LOCK_NAME).exists()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_holder_still_writing_its_record_is_named_once_it_has(tmp_path, monkeypatch):
    """A run that has taken the lock but not yet written its record (the moment two prepares race for one --out):
    the loser reads again while it waits, then names the holder rather than "holder unknown"."""
    holder = os.open(tmp_path / runlock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    record = {"pid": os.getpid(), "host": os.uname().nodename, "started": 0}
    waits = []

    def holder_writes_meanwhile(seconds: float) -> None:
        waits.append(seconds)
        os.pwrite(holder, json.dumps(record).encode(), 0)
    monkeypatch.setattr(runlock.time, "sleep", holder_writes_meanwhile)
    with pytest.raises(runlock.DirectoryInUse, match=f"in use by another run \\(pid {os.getpid()} on ") as refused:
        with runlock.hold(tmp_path, "--out"):
            pass
    assert refused.value.holder == record and len(waits) == 1
    os.close(holder)


def test_lock_file_of_a_dead_run_is_taken_over(tmp_path):
    (tmp_path / runlock.LOCK_NAME).write_text(json.dumps({"pid": dead_pid(), "host": os.uname().nodename}))
    with runlock.hold(tmp_path, "--out"):
        assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    def unsupported(_fd, _op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", unsupported)
    lock = tmp_path / runlock.LOCK_NAME
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(json.dumps({"pid": live.pid, "host": os.uname().nodename, "started": 0}))
        with pytest.raises(runlock.DirectoryInUse, match=f"in use by another run \\(pid {live.pid} on"):
            with runlock.hold(tmp_path, "--out"):
                pass
    finally:
        live.kill()
        live.wait()
    lock.write_text(json.dumps({"pid": dead_pid(), "host": os.uname().nodename}))
    with runlock.hold(tmp_path, "--out"):
        pass


def test_export_to_a_missing_directory_or_a_pt_name_is_refused(tmp_path, capsys):
    before = sorted(tmp_path.rglob("*"))
    err = one_line_error(capsys, ["export", str(tmp_path / "ck"), "--to", str(tmp_path / "nope" / "m.safetensors")])
    assert f"directory {tmp_path}/nope does not exist; create it first" in err
    err = one_line_error(capsys, ["export", str(tmp_path / "ck"), "--to", str(tmp_path / "m.pt")])
    assert f"export writes a safetensors file, so name it {tmp_path}/m.safetensors" in err
    assert sorted(tmp_path.rglob("*")) == before


# --- metrics -------------------------------------------------------------------------------------------

def test_a_full_disk_is_one_error_naming_the_file(tmp_path, monkeypatch):
    writer = MetricsWriter(str(tmp_path), enabled=True)

    def full(_fd, _data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics_module.os, "write", full)
    with pytest.raises(MetricsError, match=f"^writing {tmp_path}/metrics.jsonl failed: \\[Errno 28\\] No space"):
        writer.write({"step": 0})
    writer.close()


def test_a_short_write_is_cut_back_to_whole_lines(tmp_path, monkeypatch):
    writer = MetricsWriter(str(tmp_path), enabled=True)
    writer.write({"step": 0, "loss": 1.0})
    real_write = os.write
    monkeypatch.setattr(metrics_module.os, "write", lambda fd, data: real_write(fd, data[:7]))
    with pytest.raises(MetricsError, match="only part of a"):
        writer.write({"step": 1, "loss": 0.5})
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "loss": 1.0}\n'


def test_resuming_drops_a_torn_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"ste')
    writer = MetricsWriter(str(tmp_path), enabled=True, resume_from=2)
    writer.write({"step": 2})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]


@pytest.mark.slow  # ~20 s; a full disk mid-run stays in the default set via test_run_pins.py's tmpfs case
def test_full_disk_mid_run_stops_every_rank_after_a_final_checkpoint(tmp_path):
    """``--out`` on a file system with one page left, which the run's lock record takes: the first metrics
    record meets the full disk."""
    with small_disk(tmp_path / "disk", 32 * PAGE) as disk:
        out, ck = disk / "run", tmp_path / "ck"
        out.mkdir()
        fill_disk(disk, 1)
        result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--nproc", "2", "--dp", "2", "--steps",
                                 "5", "--global-batch", "4", "--out", str(out), "--checkpoint-dir", str(ck),
                                 "--no-tensorboard"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    # rank 0's line, echoed as it happens and again in the launcher's report of the rank that failed
    lines = {line for line in result.stderr.splitlines() if line.startswith("trainmesh: error:")}
    assert lines == {f"trainmesh: error: writing {out}/metrics.jsonl failed: [Errno 28] No space left on device; "
                     f"stopped after step 1; {ck}/step-00000001 holds step 1; free space and continue with --resume"}
    assert "trainmesh: rank 0 failed (exit code 2)" in result.stderr
    assert (ck / "latest").read_text().strip() == "step-00000001"
    assert "Traceback" not in result.stderr
