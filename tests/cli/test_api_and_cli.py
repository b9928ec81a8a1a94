"""One product: what a script on the public API writes (a checkpoint, a run directory) works with every
command of the command line, and a run started from a Hugging Face directory continues and is named as it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainmesh import checkpoint

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def trainmesh(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "trainmesh", *args], capture_output=True, text=True, env=ENV,
                         cwd=cwd, timeout=timeout)
    assert out.returncode == 0, f"trainmesh {' '.join(args)} failed:\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow  # the heaviest default case; the torchrun script test below covers a script's run in the default set
def test_a_script_checkpoint_of_an_hf_llama_at_tp2_works_with_export_generate_report_and_resume(tmp_path):
    trainmesh("launch", "--nproc", "2", str(ROOT / "examples" / "train_hf_llama.py"), "--tp", "2", "--steps", "3",
              "--layers", "2", "--out", "run", "--checkpoint-dir", "ckpt", cwd=tmp_path)
    saved = checkpoint.read_manifest(tmp_path / "ckpt" / "step-00000003")
    assert saved["model_source"]["family"] == "llama" and saved["layout"]["tp"] == 2

    trainmesh("export", "ckpt", "--hf", "hf", cwd=tmp_path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    held = {k.removeprefix("model/"): t for k, t in checkpoint.read_tensors(tmp_path / "ckpt" / "step-00000003",
                                                                            "model/").items()}
    assert held.keys() == exported.state_dict().keys()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, held[name]), f"{name} changed on its way through export --hf"

    text = trainmesh("generate", "--checkpoint-dir", "ckpt", "--prompt", "def ", "--max-new-tokens", "4",
                     cwd=tmp_path)
    assert "LlamaForCausalLM" in text.stderr and text.stdout.startswith("def ")

    report = trainmesh("report", "run", cwd=tmp_path)
    assert "steps 1-3" in report.stdout and (tmp_path / "run" / "report.png").is_file()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["config"]["tp"] == 2

    resumed = trainmesh("train", "--nproc", "2", "--dp", "2", "--resume", "--checkpoint-dir", "ckpt", "--steps", "4",
                        "--global-batch", "4", "--out", "run2", "--no-tensorboard", cwd=tmp_path)
    assert "resumed from ckpt/step-00000003" in resumed.stderr, resumed.stderr[-2000:]
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summary["model"] == saved["model_source"]["source"] and summary["steps"] == 4
    records = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4] and torch.isfinite(torch.tensor(records[0]["loss"]))


def test_an_init_hf_run_resumes_with_resume_alone_and_is_named_by_its_source(tmp_path):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    common = ("--checkpoint-dir", "ckpt", "--global-batch", "4", "--no-tensorboard", "--out", "run")
    first = trainmesh("train", "--init-hf", "llama", "--steps", "2", *common, cwd=tmp_path)
    assert "LlamaForCausalLM from llama" in first.stdout
    shutil.rmtree(tmp_path / "llama")  # the checkpoint describes its model: the directory is not needed again
    trainmesh("train", "--resume", "--steps", "3", *common, cwd=tmp_path)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "LlamaForCausalLM from llama" and summary["steps"] == 3
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3]


def test_a_script_under_torchrun_writes_a_run_and_a_checkpoint_the_command_line_reads(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          str(ROOT / "examples" / "train_hf_llama.py"), "--tp", "2", "--steps", "2", "--layers", "2",
                          "--out", "run", "--checkpoint-dir", "ckpt"],
                         capture_output=True, text=True, env={**env, "GLOO_SOCKET_IFNAME": "lo"}, cwd=tmp_path,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "steps 1-2" in trainmesh("report", "run", cwd=tmp_path).stdout
    text = trainmesh("generate", "--checkpoint-dir", "ckpt", "--prompt", "x", "--max-new-tokens", "2", cwd=tmp_path)
    assert "step 2" in text.stderr
