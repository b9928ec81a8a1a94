"""Qwen2, Qwen3, Mistral, Qwen3-MoE and DeepSeek-V3 in and out of Hugging Face: a random ``Qwen2ForCausalLM``
(tied, as the small Qwen2.5 sizes), ``Qwen3ForCausalLM`` (heads twice hidden / heads wide),
``MistralForCausalLM`` (a 4-token window in 16-token sequences, heads half hidden / heads wide),
``Qwen3MoeForCausalLM`` (a dense first layer) and ``DeepseekV3ForCausalLM`` (latent attention with
interleaved rotary weights, a sigmoid router with a random selection bias, a shared expert, a dense first layer;
and with group-limited routing) written by ``save_pretrained`` give transformers' own logits once imported, and
the same logits once exported and reloaded by transformers; the conversion round-trips every tensor bit for bit.

In float64 to 1e-10 of the logits' scale, with transformers' float32 islands (RMSNorm, rotary angles, the
DeepSeek-V3 router) lifted to the model's dtype as in ``test_hf.py``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file

import test_hf
from test_hf import TOKENS, _randomize, assert_same_logits, hf_logits
from runs import config
from trainmesh.app import checkpoints
from trainmesh.app.cli import main
from trainmesh.app.config import Config
from trainmesh.app.generate import load_model
from trainmesh.app.train import build, train
from trainmesh.checkpoint import read_manifest, recorded_model, step_dir
from trainmesh.checkpoint.manifest import check_manifest
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import hf

transformers = pytest.importorskip("transformers")
fp64_llama = test_hf.fp64_llama  # the fixture, for this module's tests

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6,
             initializer_range=0.2)
CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    # Heads wider (Qwen3, as its 0.6B and 4B) and narrower (Mistral, as Mistral-Nemo) than hidden / heads = 16.
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, head_dim=8, sliding_window=4, tie_word_embeddings=False),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, norm_topk_prob=True,
                                                     mlp_only_layers=[0], tie_word_embeddings=False),
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        tie_word_embeddings=False),
}


@pytest.fixture
def fp64_families(monkeypatch, fp64_llama):
    """Each family's RMSNorm and rotary angles in the model's dtype, with the Llama patches' code."""
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    from transformers.models.qwen3_moe import modeling_qwen3_moe

    for module, prefix in ((modeling_qwen2, "Qwen2"), (modeling_qwen3, "Qwen3"), (modeling_mistral, "Mistral"),
                           (modeling_qwen3_moe, "Qwen3Moe")):
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", ml.LlamaRMSNorm.forward)
        monkeypatch.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", ml.LlamaRotaryEmbedding.forward)

    def route(self, hidden):  # Qwen3-MoE's router, its softmax in the model's dtype rather than float32
        logits = torch.nn.functional.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        top, index = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True) if self.norm_topk_prob else top, index

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", route)
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    monkeypatch.setattr(ds.DeepseekV3RMSNorm, "forward", ml.LlamaRMSNorm.forward)
    monkeypatch.setattr(ds.DeepseekV3RotaryEmbedding, "forward", ml.LlamaRotaryEmbedding.forward)

    route, in_float64 = ds.DeepseekV3TopkRouter.forward, types.SimpleNamespace(**{**vars(torch),
                                                                                  "float32": torch.float64})

    def sigmoid_route(self, hidden):  # transformers' own DeepSeek-V3 router, its float32 casts made float64
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ds, "torch", in_float64)
            return route(self, hidden)

    monkeypatch.setattr(ds.DeepseekV3TopkRouter, "forward", sigmoid_route)


def save_family(name: str, directory: Path, seed: int = 0, **changes: object) -> Path:
    """A random float64 model of family ``name`` (biases and norm gains away from 0 and 1), its config with
    ``changes``, saved."""
    torch.manual_seed(seed)
    hf_config = CONFIGS[name]()
    hf_config.update(changes)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).double()
    _randomize(model, seed)
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):  # a selection bias that changes which experts win
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed), dtype=buffer.dtype))
    model.save_pretrained(directory)
    return directory


def _logits(directory: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """transformers' logits, experts run one by one (its grouped_mm path refuses float64 on CPU)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="sdpa", experts_implementation="eager")
    saved = load_file(directory / hf.WEIGHTS)
    with torch.no_grad():
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if tensor.dtype != torch.float64 and name in saved:  # DeepSeek's router, kept in float32: as saved
                tensor.data = saved[name]
        return model(tokens).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_imports_and_exports_with_transformers_logits(tmp_path, fp64_families, name):
    directory = save_family(name, tmp_path / "hf")
    spec, model_config, ours = hf.read_hf(directory)
    assert spec.family == name and spec.hf.architecture == json.loads((directory / "config.json").read_text())[
        "architectures"][0]
    saved = load_file(directory / hf.WEIGHTS)
    back = spec.hf.to_hf(model_config, ours)
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[k], saved[k]) for k in saved)

    expected = _logits(directory)
    model = hf.load_hf(spec.builder(model_config, 7).double(), directory)
    with torch.no_grad():
        assert_same_logits(model(TOKENS), expected, f"{name} imported, one process")
    out = hf.save_hf(model, tmp_path / "out" / "nested")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [spec.hf.architecture]
    assert_same_logits(_logits(out), expected, f"{name} exported, reloaded")


def test_deepseek_v3_with_group_limited_routing_imports_and_exports_with_transformers_logits(tmp_path,
                                                                                             fp64_families):
    """Each token's 4 of 16 experts from its best 2 of 4 groups (DeepSeek-V3's 8 of 256 from 4 of 8 groups,
    scaled down): transformers' logits imported and exported, which the same weights routed without the
    group limit miss."""
    directory = save_family("deepseek-v3", tmp_path / "hf", n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                            topk_group=2)
    spec, model_config, _ = hf.read_hf(directory)
    assert (model_config.moe.expert_groups, model_config.moe.groups_per_token) == (4, 2)
    assert spec.hf.from_config(spec.hf.to_config(model_config)) == model_config
    expected = _logits(directory)
    model = hf.load_hf(spec.builder(model_config, 7).double(), directory)
    with torch.no_grad():
        assert_same_logits(model(TOKENS), expected, "deepseek-v3 group-limited imported, one process")
        model.blocks["1"].mlp.router.cfg = dataclasses.replace(model_config.moe, groups_per_token=4)
        with pytest.raises(AssertionError, match="exceeds"):
            assert_same_logits(model(TOKENS), expected, "deepseek-v3 routed without its group limit")
    out = hf.save_hf(model, tmp_path / "out")
    assert {k: json.loads((out / "config.json").read_text())[k] for k in ("n_group", "topk_group")} == {
        "n_group": 4, "topk_group": 2}
    assert_same_logits(_logits(out), expected, "deepseek-v3 group-limited exported, reloaded")


def test_a_tied_qwen2_trains_tied_and_exports_tied(tmp_path, fp64_families):
    """Through the training path and out again."""
    directory = save_family("qwen2", tmp_path / "hf")
    run = build(Config.from_settings(init_hf=str(directory), model="qwen2-tiny", precision="fp64", progress=False),
                Mesh.build(1, 1, 1, torch.device("cpu")))
    checkpoints.restore(run)
    assert run.model.head.weight is run.model.embed.weight
    out = hf.save_hf(run.model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safetensors.safe_open(out / hf.WEIGHTS, framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert_same_logits(hf_logits(out), hf_logits(directory), "tied qwen2 trained path, exported, reloaded")



def test_a_qwen3_with_wide_heads_trains_from_hf_and_exports_them(tmp_path, fp64_families):
    """Heads twice hidden / heads wide: the manifest records ``head_dim`` (a manifest from before it reads as
    the default), and ``export --hf`` writes it, so transformers gives the trained checkpoint's logits."""
    directory, ckpt, out = save_family("qwen3", tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "out"
    train(config(init_hf=str(directory), model="qwen3-tiny", precision="fp64", steps=1, global_batch=2, seq_len=16,
                 warmup_steps=0, checkpoint_dir=str(ckpt)), Mesh.build(1, 1, 1, torch.device("cpu")))
    step = step_dir(ckpt, 1)
    manifest = read_manifest(step)
    assert manifest["model"]["head_dim"] == 32
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["head_dim"] == 32
    model, _ = load_model(step, torch.device("cpu"))
    with torch.no_grad():
        assert_same_logits(model(TOKENS), _logits(out), "qwen3 head_dim 32 trained from HF, exported")
    older = {**manifest, "model": {k: v for k, v in manifest["model"].items() if k != "head_dim"}}
    check_manifest(older, step.name)
    assert recorded_model(older, step)[1] == dataclasses.replace(recorded_model(manifest, step)[1], head_dim=None)


@pytest.mark.parametrize("source", ["transformers", pytest.param("trainmesh", marks=pytest.mark.slow)])
def test_a_deepseek_v3_folder_trains_from_hf_at_ep2_and_exports_its_logits(tmp_path, fp64_families, source, capsys):
    """Its routing biases (``e_score_correction_bias``: buffers, not parameters) are neither counted as
    parameters nor dropped: a folder transformers wrote (a random bias), or trainmesh's own export of a
    deepseek-v3-tiny run whose bias moved (trained until its logits are large enough to show a misplaced
    weight), trains with ``--init-hf`` at dp2 x ep2 and exports again with the
    source's logits. The learning rate is 1e-14, so Adam moves each weight by about that."""
    directory = tmp_path / "hf"
    if source == "transformers":
        save_family("deepseek-v3", directory)
    else:
        train(config(model="deepseek-v3-tiny", precision="fp64", steps=20, global_batch=2, seq_len=16, lr=0.03,
                     warmup_steps=0, moe_bias_rate=0.01, checkpoint_dir=str(tmp_path / "own")),
              Mesh.build(1, 1, 1, torch.device("cpu")))
        assert main(["export", str(tmp_path / "own"), "--hf", str(directory)]) == 0
    assert load_file(directory / hf.WEIGHTS)["model.layers.1.mlp.gate.e_score_correction_bias"].count_nonzero() > 0
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--init-hf", str(directory), "--nproc", "2",
                          "--dp", "2", "--ep", "2", "--steps", "1", "--global-batch", "2", "--seq-len", "16",
                          "--precision", "fp64", "--lr", "1e-14", "--min-lr", "0", "--no-progress",
                          "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out")]) == 0
    assert f"({hf.read_config(directory)[1].n_params():,} parameters, step 1)" in capsys.readouterr().out  # no bias
    assert_same_logits(_logits(tmp_path / "out"), _logits(directory),
                       f"deepseek-v3 from {source}, trained at ep2 from HF, exported")


def test_weights_that_do_not_fit_an_init_hf_folder_name_the_folder_not_a_model_never_given(tmp_path):
    directory = save_family("deepseek-v3", tmp_path / "hf")
    run = build(Config.from_settings(init_hf=str(directory), model="deepseek-v3-tiny", progress=False),
                Mesh.build(1, 1, 1, torch.device("cpu")))
    full = {**hf.read_hf(directory)[2], "extra.weight": torch.zeros(3)}
    with pytest.raises(checkpoints.CheckpointMismatch, match=rf"--init-hf {directory} holds 105,635 parameters, "
                                                             rf"the model of {directory}/config.json has 105,632; "):
        checkpoints.load_full(run, full, f"--init-hf {directory}")
