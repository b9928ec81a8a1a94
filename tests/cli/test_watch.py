"""Watching a run: TensorBoard events, ``trainmesh report``, the progress line, and one step numbering
(from 1) shared by metrics.jsonl, progress lines, TensorBoard and checkpoints."""

import io
import json
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch

from trainmesh.app import cli
from trainmesh.tracking import records as metrics
from trainmesh.app.config import Config
from trainmesh.distributed.mesh import Mesh
from trainmesh.tracking.records import METRICS_FILE, LossWindows, MetricsWriter, Progress, TensorBoardSink
from trainmesh.tracking import report as report_module
from trainmesh.tracking.report import REPORT_FILE, History, ReportError, read_records, report, summary_text
from trainmesh.app.train import train

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0 * step,
            "step_time_s": 0.01, "mfu": None, "comm_bytes": {"dp": 4096, "tp": 1024},
            "comm_bytes_by_op": {"dp/all_reduce": 4096, "tp/all_gather": 1024},
            "max_rss_bytes": [300 << 20, 310 << 20], "model_state_bytes": [2 << 20, 2 << 20],
            "peak_device_bytes": [0, 0], **extra}


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# --- sinks -------------------------------------------------------------------------------------------


def test_tensorboard_events_hold_each_quantity_and_a_restart_hides_the_replayed_steps(tmp_path):
    pytest.importorskip("tensorboard")
    first = MetricsWriter(str(tmp_path), enabled=True, sinks=[TensorBoardSink(tmp_path)])
    for step in (1, 2, 3):
        first.write(_record(step, 5.0 - step, **({"val_loss": 4.5} if step == 2 else {})))
    first.close()
    # Killed after step 3, resumed from the checkpoint of step 2: step 3 is trained and logged again.
    resumed = MetricsWriter(str(tmp_path), enabled=True, resume_from=2, sinks=[TensorBoardSink(tmp_path, 3)])
    resumed.write(_record(3, 1.5))
    resumed.close()
    scalars = _scalars(tmp_path)
    assert set(scalars) == {"train/loss", "eval/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s",
                            "perf/step_time_s", "comm_bytes/dp", "comm_bytes/tp", "memory/max_rss_bytes/rank0",
                            "memory/max_rss_bytes/rank1", "memory/model_state_bytes/rank0",
                            "memory/model_state_bytes/rank1"}
    assert scalars["train/loss"] == [(1, 4.0), (2, 3.0), (3, 1.5)]
    assert scalars["eval/loss"] == [(2, 4.5)]
    assert scalars["memory/max_rss_bytes/rank1"][0] == (1, 310 << 20)
    assert scalars["comm_bytes/tp"][0] == (1, 1024)


class _FakeWandb:
    """Records what the sink asks of ``wandb`` (the package is optional; its own offline test is below)."""

    def __init__(self):
        self.calls = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        return self

    def log(self, data, step):
        self.calls.append(("log", step, data))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_sink_logs_each_step_offline_by_default(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = {"lr": 1, "dp": 2, "tp": 2, "pp": 1, "zero": 1, "precision": "bf16"}
    writer = MetricsWriter(str(tmp_path), enabled=True, sinks=metrics.open_sinks(tmp_path, False, "proj", config))
    writer.write(_record(1, 4.0))
    writer.close()
    (_, init), (_, step, data), finish = fake.calls
    run_id = (tmp_path / metrics.WANDB_ID_FILE).read_text()
    assert init == {"project": "proj", "dir": str(tmp_path), "name": tmp_path.name, "config": config,
                    "group": "dp2 tp2 pp1 zero1", "job_type": "bf16", "id": run_id, "resume": "allow",
                    "mode": "offline"}
    assert step == 1 and data == metrics.scalars(_record(1, 4.0)) and finish == ("finish",)


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    sink = metrics.WandbSink("trainmesh-test", tmp_path, {"steps": 1})
    sink.write(_record(1, 4.0))
    sink.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_groups_runs_by_layout_and_precision_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch):
    """Offline: the group and job type say the layout and precision; a resumed run (resume_from) opens the
    W&B run of the same id again, a fresh run in another directory a new one."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = {"dp": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "zero": 0, "precision": "fp32", "lr": 3e-4}
    first = metrics.WandbSink("trainmesh-test", tmp_path / "a", config)
    first.write(_record(1, 4.0))
    ids = [first._run.id]
    assert (first._run.group, first._run.job_type) == ("dp2 cp1 tp1 pp1 ep1 zero0", "fp32")
    first.close()
    resumed = metrics.WandbSink("trainmesh-test", tmp_path / "a", config, resume_from=1)
    resumed.write(_record(2, 3.5))
    ids.append(resumed._run.id)
    resumed.close()
    other = metrics.WandbSink("trainmesh-test", tmp_path / "b", {**config, "precision": "bf16"})
    assert other._run.job_type == "bf16"
    ids.append(other._run.id)
    other.close()
    assert ids[0] == ids[1] == (tmp_path / "a" / metrics.WANDB_ID_FILE).read_text() != ids[2]
    runs = list((tmp_path / "a" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(ids[0] in run.name for run in runs)


def test_wandb_without_the_package_is_one_line_before_any_rank(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(metrics, "package_available", lambda name: name != "wandb")
    assert cli.main(["train", "--wandb", "proj", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ("trainmesh: error: --wandb proj needs the wandb package: pip install wandb, "
                                       "or drop --wandb\n")
    assert not (tmp_path / "run").exists()


# --- one run, read every way -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """A 6-step run evaluating every 3 steps and saving at step 3 and 6, resumed to step 8; its output."""
    root = tmp_path_factory.mktemp("watched")
    cfg = Config.from_settings(steps=6, global_batch=4, warmup_steps=1, eval_every=3, eval_batches=1, out=str(root / "run"),
                               checkpoint_dir=str(root / "ckpt"), checkpoint_every=3, progress_every=2)
    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    stdout, sys.stdout = sys.stdout, io.StringIO()
    try:
        first = train(cfg, mesh)
        resumed = train(Config.from_settings(**{**cfg.settings(), "steps": 8, "resume": True}), mesh)
        printed = sys.stdout.getvalue()
    finally:
        sys.stdout = stdout
    return root, first, resumed, printed


def test_steps_count_from_one_in_metrics_progress_tensorboard_and_checkpoints(run_dirs):
    root, _, _, printed = run_dirs
    records = [json.loads(line) for line in (root / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[6]["restart"] == {"from_step": 6, "replayed_steps": 0}
    assert sorted(p.name for p in (root / "ckpt").glob("step-*")) == ["step-00000003", "step-00000006",
                                                                       "step-00000008"]
    shown = [int(m) for m in re.findall(r"^step (\d+)/\d+ ", printed, re.M)]
    assert shown == [1, 2, 4, 6] + [7, 8], "plain lines: the first step, every 2nd, the last"
    if metrics.package_available("tensorboard"):
        assert [s for s, _ in _scalars(root / "run")["train/loss"]] == list(range(1, 9))


def test_every_evaluation_including_the_last_is_in_metrics_and_shown_in_progress(run_dirs):
    root, first, resumed, printed = run_dirs
    records = [json.loads(line) for line in (root / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6, 8]
    assert records[5]["val_loss"] == first.val_loss == first.summary["val_loss"]
    assert records[7]["val_loss"] == resumed.val_loss
    assert f"step 4/6 | loss {records[3]['loss']:.4f} | val {records[2]['val_loss']:.4f} |" in printed


def test_the_done_line_compares_window_means(run_dirs):
    _, first, _, printed = run_dirs
    windows = LossWindows.of(first.losses)
    assert windows.steps == 1  # a tenth of 6 steps, rounded, at least one
    assert f"done: loss {windows.first:.4f} -> {windows.last:.4f} (mean of the first and last step), " in printed
    spike = LossWindows.of([5.0] * 5 + [3.0] * 14 + [9.0])  # 20 steps: windows of 2
    assert (spike.steps, spike.first, spike.last) == (2, 5.0, 6.0)


def test_report_draws_a_png_and_summarises_the_run(run_dirs, capsys):
    root = run_dirs[0]
    assert cli.main(["report", str(root / "run")]) == 0
    text = capsys.readouterr().out
    assert (root / "run" / REPORT_FILE).read_bytes().startswith(PNG_SIGNATURE)
    assert "steps 1-8 (8 records)" in text
    assert "(mean of the first and last step)" in text
    assert re.search(r"eval loss \d\.\d{4} at step 8 \(best \d\.\d{4} at step \d\)", text)
    assert re.search(r"peak RSS per rank: [\d.]+ [KMG]iB\n", text)
    assert "no communication (one rank)" in text and "resumed from the checkpoint of step 6" in text


def _run_dir(path, records: list[dict], config: dict | None = None):
    path.mkdir()
    (path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "summary.json").write_text(json.dumps({"model": "tiny", "config": config}))
    return path


def test_report_of_two_runs_overlays_them_labelled_by_what_differs(tmp_path, capsys):
    """Two layouts and learning rates: one figure, a label and a table row each naming only what differs."""
    config = {"model": "tiny", "dp": 2, "tp": 1, "pp": 1, "zero": 0, "precision": "fp32", "lr": 1e-3,
              "out": "a", "seed": 0}
    a = _run_dir(tmp_path / "a", [_record(s, 5.0 - s / 10) for s in (1, 2, 3)], config)
    b = _run_dir(tmp_path / "b", [_record(s, 5.0 - s / 5) for s in (1, 2, 3)],
                 {**config, "dp": 1, "tp": 2, "lr": 3e-3, "out": "b"})
    png = tmp_path / "both.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cli.main(["report", str(a), str(b), "--png", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 runs; they differ in dp, tp, lr"
    assert lines[1].split() == ["run", "dp", "tp", "lr", "last", "loss", "eval", "loss", "tokens/s", "peak",
                                "memory"]
    assert lines[2].split()[:5] == [str(a), "2", "1", "0.001", "4.7000"]
    assert lines[3].split()[:5] == [str(b), "1", "2", "0.003", "4.4000"]
    assert lines[-1] == f"  figure: {png}" and png.read_bytes().startswith(PNG_SIGNATURE)
    runs = [report_module.Run.read(d) for d in (a, b)]
    assert report_module._labels(runs, report_module.differences(runs)) == ["dp=2 tp=1 lr=0.001",
                                                                              "dp=1 tp=2 lr=0.003"]
    assert runs[0].history.tokens == [10.0, 30.0, 60.0]  # tokens/s x step time, summed


def test_report_of_a_run_with_nothing_to_label_warns_nothing(tmp_path):
    """A script's run without memory or tokens: the memory panel says so instead of an empty legend."""
    run = _run_dir(tmp_path / "script", [{"step": s, "loss": 5.0 - s / 10, "step_time_s": 0.1} for s in (1, 2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "figure:" in report(run)
        assert "figure:" in report_module.compare([run, run], tmp_path / "twice.png")


def test_report_refuses_a_directory_without_records(tmp_path):
    with pytest.raises(ReportError, match=f"^{tmp_path} has no metrics.jsonl; give the run directory"):
        report(tmp_path)
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "lo')
    with pytest.raises(ReportError, match="holds no step records yet"):
        report(tmp_path)


RECORD = {"step": 1, "loss": 5.5, "tokens_per_s": 1000.0, "mfu": None, "comm_bytes_by_op": {},
          "max_rss_bytes": [1 << 20]}


@pytest.mark.parametrize("case", ["string loss", "string tokens_per_s", "list memory", "binary bytes", "fifo",
                                  "missing tokens_per_s"])
def test_report_on_a_tampered_metrics_file_is_one_line_at_once(tmp_path, case):
    """A record with a field of the wrong type, bytes that are not text, a FIFO in place of the file: one
    line naming the file (and the line), at once; a record without tokens_per_s (a script's) is drawn."""
    path = tmp_path / METRICS_FILE
    records = [dict(RECORD), dict(RECORD, step=2, loss=5.0)]
    expect = {"string loss": "line 2: loss is \"abc\", not a number",
              "string tokens_per_s": "line 2: tokens_per_s is \"fast\", not a number",
              "list memory": "line 2: max_rss_bytes is not a list of byte counts",
              "binary bytes": "is not UTF-8 text (invalid byte 0xff at offset ",
              "fifo": "metrics.jsonl is a FIFO, not a regular file"}.get(case)
    records[1].update({"string loss": {"loss": "abc"}, "string tokens_per_s": {"tokens_per_s": "fast"},
                       "list memory": {"max_rss_bytes": "lots"}}.get(case, {}))
    if case == "missing tokens_per_s":
        del records[1]["tokens_per_s"]
    if case == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records)
                         + (b"\xff\xfe\x00garbage\n" if case == "binary bytes" else b""))
    start = time.monotonic()
    if expect is None:
        assert "steps 1-2 (2 records)" in summary_text(History.of(read_records(tmp_path)), tmp_path)
        return
    with pytest.raises(ReportError) as e:
        report(tmp_path)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert time.monotonic() - start < 5


# --- the progress line -------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    """A stream that says it is a terminal; :func:`_screen` replays what was written to it."""

    def isatty(self):
        return True


def _screen(written: str) -> list[str]:
    """The lines a terminal shows after ``written``: ``\\r`` returns to the line's start, text overwrites."""
    lines, col = [""], 0
    for chunk in re.split(r"(\r|\n)", written):
        if chunk == "\r":
            col = 0
        elif chunk == "\n":
            lines.append("")
            col = 0
        else:
            line = lines[-1]
            lines[-1] = line[:col] + chunk + line[col + len(chunk):]
            col += len(chunk)
    return [line.rstrip() for line in lines if line.strip()]


def test_terminal_progress_is_one_bar_with_eta_and_eval_loss_and_messages_leave_no_debris():
    pytest.importorskip("tqdm")
    term = _Terminal()
    progress = Progress(10, 1, term)
    for step in range(1, 11):
        progress.update(_record(step, 5.0 - 0.1 * step, **({"val_loss": 4.25} if step == 5 else {})))
        if step == 6:
            with progress.paused():  # a checkpoint notice, printed to stderr as checkpoint.save does
                print("trainmesh: saved ckpt/step-00000006 (2 files, 1.6 MiB) in 0.06 s", file=sys.stderr)
    progress.close()
    progress.message("done: ...")
    screen = _screen(term.getvalue())
    assert screen[0] == "trainmesh: saved ckpt/step-00000006 (2 files, 1.6 MiB) in 0.06 s"
    assert re.fullmatch(r"step 10/10 \|[^|]{20}\| \d\d:\d\d<\d\d:\d\d, loss 4\.0000 \| val 4\.2500 \| 10,000 tok/s \| "
                        r"10 ms/step", screen[1]), screen[1]
    assert screen[2:] == ["done: ..."]


def test_plain_progress_prints_every_nth_step_and_no_progress_keeps_messages():
    plain = io.StringIO()
    progress = Progress(100, 1, plain)
    for step in range(1, 101):
        progress.update(_record(step, 2.0))
    lines = plain.getvalue().splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [1, *range(5, 101, 5)]
    assert re.fullmatch(r"step  50/100 \| loss 2\.0000 \| 50,000 tok/s \| 10 ms/step \| elapsed \d:\d\d:\d\d \| "
                        r"ETA \d:\d\d:\d\d", lines[10])
    quiet = io.StringIO()
    hidden = Progress(100, 1, quiet, enabled=False)
    hidden.update(_record(1, 2.0))
    hidden.message("done: loss 2.0000 -> 2.0000")
    assert quiet.getvalue() == "done: loss 2.0000 -> 2.0000\n"


# --- without the optional packages -------------------------------------------------------------------

BLOCK = """
import sys
import time
sys.modules.update(dict.fromkeys(("tensorboard", "tqdm", "matplotlib", "rich", "wandb")))  # as if not installed
"""


def test_training_needs_none_of_the_watch_packages(tmp_path):
    code = BLOCK + f"""
from trainmesh.app import cli
assert cli.main(["train", "--steps", "2", "--global-batch", "2", "--eval-batches", "1", "--out", {str(tmp_path)!r}]) == 0
assert cli.main(["report", {str(tmp_path)!r}]) == 2
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "done: loss" in result.stdout and not list(tmp_path.glob("events.out.tfevents.*"))
    assert result.stderr.strip() == "trainmesh: error: trainmesh report draws with matplotlib: pip install " \
                                    "'trainmesh[watch]'"
