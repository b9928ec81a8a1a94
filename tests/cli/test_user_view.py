"""What a user sees (issue #51): every rank's output kept and streamed on request, help text in plain words,
the planner's differences shown, dependencies' noise dropped at its source, and a walk-through of the
commands that prints nothing but trainmesh's own lines."""

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainmesh.app import cli
from trainmesh.distributed.launcher import TERMINAL_ENV
from trainmesh.plan.table import apart
from trainmesh.tracking.quiet import quiet_dependencies
from trainmesh.tracking.records import Progress

ROOT = Path(__file__).resolve().parents[2]
OWN_LINE = re.compile(r"^(\[rank \d+\] )?trainmesh: ")


def trainmesh(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-m", "trainmesh", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_launch_keeps_every_ranks_output_and_tee_streams_the_chosen_ranks_prefixed(tmp_path):
    """--log-dir: each rank's stdout and stderr under a header naming its host; --tee 1 streams rank 1 alone,
    each line prefixed, and rank 0's output only reaches its log."""
    script = tmp_path / "speak.py"
    script.write_text("import os, sys\nrank = os.environ['RANK']\nprint(f'out of {rank}', flush=True)\n"
                      "print(f'err of {rank}', file=sys.stderr, flush=True)\nprint('no newline', end='')\n")
    result = trainmesh("launch", "--nproc", "2", "--log-dir", "logs", "--tee", "1", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    ranks = [line for line in result.stdout.splitlines() if not line.startswith("trainmesh launch: ")]
    assert ranks == ["[rank 1] out of 1", "[rank 1] no newline"]
    assert result.stderr.splitlines() == ["[rank 1] err of 1"]
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank-{rank}.log").read_text()
        assert re.match(rf"==> rank {rank} of 2 \(local rank {rank}\) on \S+, pid \d+, started \S+ <==\n", log), log
        assert f"out of {rank}\n" in log and f"err of {rank}\n" in log and "no newline" in log


def test_train_keeps_each_ranks_log_in_out_and_tee_all_prefixes_every_line(tmp_path):
    result = trainmesh("train", "--nproc", "2", "--dp", "2", "--steps", "2", "--global-batch", "4", "--out", "run",
                       "--tee", "all", "--no-tensorboard", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\n[rank 0] trainmesh: tiny (" in "\n" + result.stdout and "\n[rank 0] done: loss" in result.stdout
    assert "trainmesh: tiny (" in (tmp_path / "run" / "logs" / "rank-0.log").read_text()
    assert (tmp_path / "run" / "logs" / "rank-1.log").read_text().startswith("==> rank 1 of 2 ")


def test_rank_0_streamed_to_a_terminal_through_the_launchers_pipe_draws_its_bar(monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setenv(TERMINAL_ENV, "1")
    assert Progress(10, 1, sys.stdout)._terminal and not Progress(10, 1, io.StringIO())._terminal
    monkeypatch.delenv(TERMINAL_ENV)
    assert not Progress(10, 1, sys.stdout)._terminal


@pytest.mark.parametrize("tee, problem", [("2", "--tee 2: the ranks are 0 to 1; give some of them (0,1) or all"),
                                          ("one", "--tee 'one': give rank numbers separated by commas (0,1) or all")])
def test_tee_of_no_rank_of_the_run_is_one_line(tmp_path, capsys, tee, problem):
    assert cli.main(["train", "--nproc", "2", "--dp", "2", "--tee", tee, "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == f"trainmesh: error: {problem}\n"


def test_help_is_plain_text_and_says_each_default_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and ":mod:" not in top and "Train one model across many processes" in top
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    flags = re.split(r"\n  (?=-)", capsys.readouterr().out)
    assert len(flags) > 50
    assert [f for f in flags if f.count("(default:") > 1 or "(default: )" in f] == []
    data = next(f for f in flags if f.startswith("--data"))
    assert " ".join(data.split()).count("default: this Python's standard library sources") == 1


def test_the_planner_prints_differences_at_a_precision_that_shows_them():
    gib, mib = 2**30, 2**20
    assert apart(15.04 * gib, 14.97 * gib) == ("15.04 GiB", "14.97 GiB")
    assert apart(15 * gib, 15 * gib + 5 * mib) == ("15360.0 MiB", "15365.0 MiB")
    assert apart(15 * gib, 15 * gib) == ("15.0 GiB", "15.0 GiB")
    assert apart(15.3 * gib, 14.1 * gib) == ("15.3 GiB", "14.1 GiB")


@pytest.mark.parametrize("logger, noise, kept", [
    ("torchao", "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load "
                "this library", "Skipping import of cpp extensions due to incompatible torch version"),
    ("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                            "torch.compile as an opaque value type.", "some other pytree warning")])
def test_only_the_dependencies_lines_that_tell_nothing_are_dropped(caplog, logger, noise, kept):
    quiet_dependencies()
    quiet_dependencies()  # once is enough; twice installs nothing more
    assert len(logging.getLogger(logger).filters) == 1
    with caplog.at_level(logging.WARNING, logger=logger):
        logging.getLogger(logger).warning(noise)
        logging.getLogger(logger).warning(kept)
    assert [r.getMessage() for r in caplog.records] == [kept]


def _only_own_lines(result: subprocess.CompletedProcess, what: str) -> None:
    assert result.returncode == 0, f"{what}: {result.stderr}"
    foreign = [line for line in result.stderr.splitlines() if not OWN_LINE.match(line)]
    assert foreign == [], f"{what} printed: {foreign}"


@pytest.mark.slow  # 28 s: five commands end to end
def test_a_walk_through_prints_only_trainmeshs_own_lines(tmp_path):
    """Train two runs, report them together, export and decode one, run a script under launch and report it:
    stderr holds only trainmesh's lines (no deprecation, no kernel library, no matplotlib warning)."""
    common = ("--nproc", "2", "--model", "tiny", "--steps", "3", "--global-batch", "4", "--no-progress")
    _only_own_lines(trainmesh("train", *common, "--dp", "2", "--out", "runs/a", cwd=tmp_path), "train a")
    _only_own_lines(trainmesh("train", *common, "--tp", "2", "--lr", "1e-3", "--out", "runs/b", "--checkpoint-dir",
                              "ckpt", cwd=tmp_path), "train b")
    both = trainmesh("report", "runs/a", "runs/b", cwd=tmp_path)
    _only_own_lines(both, "report a b")
    assert both.stdout.startswith("2 runs; they differ in dp, tp, lr\n")
    _only_own_lines(trainmesh("export", "ckpt", "--hf", "hf", cwd=tmp_path), "export --hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    _only_own_lines(trainmesh("generate", "--checkpoint-dir", "ckpt", "--prompt", "def ", "--max-new-tokens", "4",
                              cwd=tmp_path), "generate")
    _only_own_lines(trainmesh("launch", "--nproc", "2", str(ROOT / "examples" / "train_hf_llama.py"), "--steps",
                              "3", "--layers", "2", "--out", "runs/script", cwd=tmp_path), "launch")
    script = trainmesh("report", "runs/script", cwd=tmp_path)
    _only_own_lines(script, "report script")
    assert re.search(r"\n  peak RSS per rank: [\d.]+ MiB, [\d.]+ MiB\n", script.stdout), script.stdout
    assert re.search(r"\n  model state per rank: [\d.]+ [KM]iB, [\d.]+ [KM]iB\n", script.stdout), script.stdout
    first = json.loads((tmp_path / "runs" / "script" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["layout"]["world_size"] == 2 and first["comm_bytes"]["dp"] > 0
