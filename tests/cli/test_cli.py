"""The command line: every flag documented, bad configs rejected before any rank is spawned, a failing
rank stops the run and is named."""

import json
import os
import subprocess
import sys
import pytest

from trainmesh.app import cli
from trainmesh.distributed import launcher
from trainmesh.app.config import FIELDS


def trainmesh(*args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "trainmesh", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in text


BAD = [
    (["--nproc", "2", "--dp", "4"], "world size 2 != dp*cp*tp*pp"),
    (["--nproc", "4", "--dp", "2", "--tp", "2", "--global-batch", "6", "--microbatches", "2"],
     "not divisible by dp*microbatches"),
    (["--model", "nope"], "--model nope: choose tiny"),
    (["--nproc", "4096", "--dp", "4096"], "more local ranks than this machine"),
    (["--nproc", "3", "--tp", "3"], "--tp 3 does not divide n_heads=4"),
    (["--model", "llama-tiny", "--nproc", "4", "--tp", "4"], "--tp 4 exceeds n_kv_heads=2 of llama-tiny"),
    (["--pp", "3", "--nproc", "3"], "exceeds the 2 layers"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--config", "/nonexistent.toml"], "does not exist"),
    (["--nproc", "4", "--cp", "2"], "world size 4 != dp*cp*tp*pp"),
    (["--nproc", "2", "--cp", "2", "--seq-len", "90"], "2*cp=4 equal chunks"),
    (["--model", "llama-tiny", "--nproc", "4", "--cp", "2", "--tp", "2", "--cp-impl", "a2a"],
     "n_heads=4 and n_kv_heads=2 do not divide by it; choose cp in {1} with --tp 2"),
    (["--nproc", "4", "--cp", "2", "--pp", "2", "--schedule", "zb"], "--cp 2 with --schedule zb"),
    (["--nproc", "2", "--cp", "2", "--compile"], "--cp 2 with --compile would trace the ring"),
    (["--cuda-graphs"], "--cuda-graphs captures the compiled blocks as CUDA graphs; add --compile"),
    (["--document-mask"], "--document-mask: the default corpus is not prepared data"),
    (["--document-mask", "--compile"], "--document-mask changes every micro-batch's masks and positions"),
    (["--model", "llama3-405b", "--nproc", "2", "--dp", "2", "--zero", "3"],
     "--model llama3-405b at this layout needs 3023.8 GiB of model state on each rank, more than the"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_config_fails_before_spawn(monkeypatch, capsys, args, message):
    def no_spawn(*_a, **_k):
        raise AssertionError("a rank was spawned for an invalid config")

    monkeypatch.setattr(launcher, "launch", no_spawn)
    try:
        code = cli.main(["train", *args])
    except SystemExit as e:  # argparse's own errors (unknown choice) exit 2 too
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_version_is_the_installed_packages_from_the_shell_and_the_api():
    from importlib.metadata import version

    import trainmesh

    result = subprocess.run([sys.executable, "-m", "trainmesh", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"trainmesh {version('trainmesh')}", result
    assert trainmesh.__version__ == version("trainmesh")


def test_train_says_what_starts_before_torch_is_imported(tmp_path):
    """The first line comes before the second-long import of torch (the order of events, not a time): the
    entry point and the package's face import no torch, and the line is the run's first."""
    probe = ("import sys, trainmesh, trainmesh.app.entry; "
             "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules), sorted(sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).returncode == 0
    result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--steps", "0", "--out", str(tmp_path / "r")],
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[0] == "trainmesh train: checking the run before any rank starts", result


def test_bad_config_exit_code_from_the_shell(tmp_path):
    result = trainmesh("train", "--nproc", "2", "--dp", "4", "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "trainmesh: error: world size 2 != dp*cp*tp*pp = 4*1*1*1 = 4; launch 4 rank(s) (--nproc 4) or change "
        "--dp/--cp/--tp/--pp so their product is 2"]
    assert not (tmp_path / "run").exists()


def test_toml_config_and_flag_override(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[layout]\ndp = 2\n[launch]\nnproc = 2\n[optim]\nsteps = 7\nlr = 0.01\n')
    args = cli._parser().parse_args(["train", "--config", str(toml), "--steps", "3"])
    cfg = cli.config_from_args(args)
    assert (cfg.layout.dp, cfg.launch.nproc, cfg.optim.steps, cfg.optim.lr) == (2, 2, 3, 0.01)


def test_failing_rank_stops_the_run_and_is_named(tmp_path):
    """The launcher stops rank 0 as soon as rank 1 fails: rank 0 never trains on to its 500th step, and no
    collective timeout is what ended it (the order of events, not a wall-clock bound a busy machine breaks)."""
    result = trainmesh("train", "--nproc", "2", "--dp", "2", "--steps", "500", "--out", str(tmp_path / "r"),
                       env={"TRAINMESH_FAULT": "raise@1:3"}, timeout=300)
    assert result.returncode != 0
    assert "rank 1 failed (exit code 1)" in result.stderr
    assert "injected fault on rank 1 at step 3" in result.stderr
    assert "timed out" not in result.stderr.lower() and "timeout" not in result.stderr.lower()
    metrics = tmp_path / "r" / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    assert max(steps, default=0) < 500


def test_two_rank_run_writes_metrics(tmp_path):
    out = tmp_path / "run"
    result = trainmesh("train", "--nproc", "2", "--dp", "2", "--steps", "4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "lr", "tokens_per_s", "step_time_s", "comm_bytes", "max_rss_bytes", "model_state_bytes"):
        assert key in records[0]
    assert len(records[0]["model_state_bytes"]) == 2
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    assert "loss" in result.stdout and "tok/s" in result.stdout
