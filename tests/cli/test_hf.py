"""Hugging Face checkpoints in and out: a random-init ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` written by
``save_pretrained`` and imported through the training path (at tp2 x pp2) gives transformers' own logits,
and a trainmesh checkpoint exported with ``export --hf`` reloads in transformers with the same logits.

Every comparison is in float64 and held to :data:`REL` of the logits' scale. transformers' Llama computes
RMSNorm and the RoPE angles in float32 whatever the model's dtype, which would cap the comparison near
fp32's 1e-7; :func:`fp64_llama` lifts exactly those two islands to the model's dtype in this process (the
ranks run trainmesh only), leaving every layout under test (the q/k/v split, KV-group order, rotate-half,
``[gate | up]``, tying, Conv1D) to transformers' own code. A wrong head order or transpose moves logits by
O(1); fp64 rounding over two layers moves them by about 1e-15 of their scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from trainmesh import checkpoint
from trainmesh.app import checkpoints
from trainmesh.models import hf
from trainmesh.app.cli import main
from trainmesh.app.config import Config, ConfigError, config_from_args, validate
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import gpt, llama, moe, spec_of
from trainmesh.distributed.testing import run_ranks
from trainmesh.app.train import build, setup_process

transformers = pytest.importorskip("transformers")

REL = 1e-10
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
FIGURES: dict[str, float] = {}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm gains and biases away from HF's 1/0 init, so a norm or bias mapped to the wrong place shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)


def save_hf_llama(directory: Path, tie: bool = False, seed: int = 0, shard_size: str = "5GB") -> Path:
    """A random GQA Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) written by ``save_pretrained``."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                   initializer_range=0.2)
    return _save_random(transformers.LlamaForCausalLM, cfg, directory, seed, shard_size=shard_size)


def _save_random(model_class, cfg, directory: Path, seed: int, shard_size: str | None = None) -> Path:
    """A float64 ``model_class`` of ``cfg`` with random weights from ``seed``, written by ``save_pretrained``."""
    torch.manual_seed(seed)
    model = model_class(cfg).double()
    _randomize(model, seed)
    model.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
    return directory


def save_hf_gpt2(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random GPT-2 (hidden 64, 2 layers, 4 heads) with GPT-2's tied head, written by ``save_pretrained``."""
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                  initializer_range=0.2, **overrides)
    return _save_random(transformers.GPT2LMHeadModel, cfg, directory, seed)


@pytest.fixture
def fp64_llama(monkeypatch):
    """transformers' Llama RMSNorm and rotary angles in the model's dtype instead of float32 (see above)."""
    from transformers.models.llama import modeling_llama as ml

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        dim = self.inv_freq.numel() * 2
        theta = (getattr(self.config, "rope_parameters", None) or {}).get("rope_theta") or self.config.rope_theta
        inv_freq = theta ** -(torch.arange(0, dim, 2, dtype=x.dtype) / dim)
        angles = position_ids[..., None].to(x.dtype) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    monkeypatch.setattr(ml.LlamaRMSNorm, "forward", rms_norm)
    monkeypatch.setattr(ml.LlamaRotaryEmbedding, "forward", rotary)


def hf_logits(directory: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                              attn_implementation="sdpa")
    with torch.no_grad():
        return model(tokens).logits


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> float:
    """max |Δlogit| within :data:`REL` of the logits' largest magnitude; recorded for the report."""
    diff = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    assert scale > 1.0, f"{what}: logits of scale {scale} would not show a misplaced weight"
    assert diff <= REL * scale, f"{what}: max |dlogit| {diff:.3e} exceeds {REL:g} x {scale:.2f}"
    FIGURES[what] = diff
    return diff


# --- pure conversion, no processes -----------------------------------------------------------------------

def test_llama_qkv_fusion_puts_each_query_head_with_its_kv_head():
    """Rows labelled by head: fused group g holds query heads 2g and 2g+1 (group 2), then K_g, then V_g,
    the pairing HF's ``repeat_kv`` uses (query head j attends with KV head j // group)."""
    cfg = llama.LlamaConfig(n_layers=1, d_model=8, n_heads=4, n_kv_heads=2, d_ff=8, vocab_size=8, seq_len=4)
    hd = cfg.head_size
    q = torch.arange(4).repeat_interleave(hd)[:, None].expand(-1, 8).double()
    k = 10 + torch.arange(2).repeat_interleave(hd)[:, None].expand(-1, 8).double()
    v = 20 + torch.arange(2).repeat_interleave(hd)[:, None].expand(-1, 8).double()
    fused = llama.fuse_qkv(cfg, q, k, v)
    labels = fused[::hd, 0].tolist()
    assert labels == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(llama.split_qkv(cfg, fused), (q, k, v)))


@pytest.mark.parametrize("save", [save_hf_llama, save_hf_gpt2])
def test_conversion_round_trips_every_tensor_bit_for_bit(tmp_path, save):
    directory = save(tmp_path / "hf")
    spec, model_config, ours = hf.read_hf(directory)
    original = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).state_dict()
    back = spec.hf.to_hf(model_config, ours)
    for name, tensor in back.items():
        assert torch.equal(tensor, original[name]), name


def test_llama_and_gpt2_import_gives_transformers_logits(tmp_path, fp64_llama):
    for name, save in (("llama", save_hf_llama), ("gpt2", save_hf_gpt2)):
        directory = save(tmp_path / name)
        spec, model_config, _ = hf.read_hf(directory)
        model = hf.load_hf(spec.builder(model_config, 7).double(), directory)
        with torch.no_grad():
            assert_same_logits(model(TOKENS), hf_logits(directory), f"{name} imported, one process")


def test_sharded_safetensors_are_read_through_their_index(tmp_path, fp64_llama):
    directory = save_hf_llama(tmp_path / "hf", shard_size="200KB")
    assert not (directory / hf.WEIGHTS).exists() and len(hf.weight_files(directory)) > 1
    spec, model_config = hf.check_weights(directory)
    model = hf.load_hf(spec.builder(model_config, 7).double(), directory)
    with torch.no_grad():
        assert_same_logits(model(TOKENS), hf_logits(directory), "sharded llama imported, one process")


def test_tied_llama_imports_and_exports_tied(tmp_path, fp64_llama):
    """A tied Llama (no ``lm_head.weight`` stored) through the training path's loading (one process), then out
    again: still tied, same logits."""
    directory = save_hf_llama(tmp_path / "hf", tie=True)
    cfg = Config.from_settings(init_hf=str(directory), model="llama-tiny", precision="fp64", progress=False)
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    checkpoints.restore(run)
    assert run.model.head.weight is run.model.embed.weight
    with torch.no_grad():
        assert_same_logits(run.model(TOKENS), hf_logits(directory), "tied llama imported, one process")
    out = hf.save_hf(run.model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safetensors.safe_open(out / hf.WEIGHTS, framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert_same_logits(hf_logits(out), hf_logits(directory), "tied llama exported, reloaded")


# --- tp2 x pp2 through the training path, and export --hf of its checkpoint ------------------------------

def _import_and_save(cfgs: list[Config]) -> list[tuple[int, int, torch.Tensor | None]]:
    """On each rank: build each config's run, load ``--init-hf`` as training does, forward TOKENS through
    the pipeline capturing this rank's logits shard (last stage only), and save a checkpoint."""
    torch.set_num_threads(1)
    mesh = setup_process(cfgs[0])
    out = []
    for cfg in cfgs:
        run = build(cfg, mesh)
        start = checkpoints.restore(run)
        captured = []

        def capture(logits, targets, criterion=run.criterion):
            captured.append(logits.detach().clone())
            return criterion(logits, targets)

        with torch.no_grad():
            run.pipeline.evaluate([(TOKENS, TOKENS.roll(-1, 1))], capture)
        checkpoints.save(run, start)
        out.append((mesh.rank("pp"), mesh.rank("tp"), captured[0] if captured else None))
    return out


def _full_logits(per_rank: list[tuple[int, int, torch.Tensor | None]]) -> torch.Tensor:
    """The last stage's vocabulary shards, in tp order, joined."""
    shards = sorted((tp, logits) for pp, tp, logits in per_rank if logits is not None)
    return torch.cat([logits for _, logits in shards], dim=-1)


def test_import_at_tp2_pp2_and_export_hf_round_trip(tmp_path, fp64_llama):
    dirs = {"llama": save_hf_llama(tmp_path / "llama"), "gpt2": save_hf_gpt2(tmp_path / "gpt2")}
    base = dict(tp=2, pp=2, nproc=4, precision="fp64", progress=False, global_batch=2)
    cfgs = [config_from_args(_args(init_hf=str(d), checkpoint_dir=str(tmp_path / f"ckpt-{name}"), **base))
            for name, d in dirs.items()]
    assert [cfg.model.model for cfg in cfgs] == ["llama-tiny", "tiny"]
    results = run_ranks(_import_and_save, 4, cfgs, timeout=120)
    for k, (name, directory) in enumerate(dirs.items()):
        expected = hf_logits(directory)
        assert_same_logits(_full_logits([r[k] for r in results]), expected, f"{name} imported at tp2 pp2")
        out = tmp_path / f"out-{name}"
        assert main(["export", str(tmp_path / f"ckpt-{name}"), "--hf", str(out)]) == 0
        architecture = json.loads((out / "config.json").read_text())["architectures"]
        assert architecture == [spec_of(cfgs[k].model.model).hf.architecture]
        assert_same_logits(hf_logits(out), expected, f"{name} tp2 pp2 checkpoint exported, reloaded")


def _args(**values):
    """An argparse namespace holding just these flags, as the CLI parses them (text for non-bools)."""
    return argparse.Namespace(**{k: v if isinstance(v, bool) else str(v) for k, v in values.items()})


def test_export_hf_of_native_models_reloads_in_transformers(tmp_path, fp64_llama):
    """trainmesh's own models, untied Llama with GQA and GPT, out to transformers and back in."""
    for name, model_config in (("llama", llama.LlamaConfig(2, 64, 4, 2, 96, 256, 32, rope_theta=1e4)),
                               ("gpt", gpt.ModelConfig(2, 64, 4, 128, 256, 32))):
        model = hf.spec_of_config(model_config).builder(model_config, 3).double()
        _randomize(model, 3)
        with torch.no_grad():
            model.head.weight.mul_(20)  # logits of order 1, so the relative bound means something
            ours = model(TOKENS)
        out = hf.save_hf(model, tmp_path / name)
        assert_same_logits(hf_logits(out), ours, f"native {name} exported, reloaded")
        again = hf.load_hf(hf.spec_of_config(model_config).builder(model_config, 4).double(), out)
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


# --- what is refused, before any rank starts --------------------------------------------------------------

def test_refusals_are_one_line(tmp_path, capsys):
    llama_dir = save_hf_llama(tmp_path / "llama")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text((llama_dir / "config.json").read_text())
    (bin_only / "pytorch_model.bin").write_bytes(b"not loaded")
    erf = save_hf_gpt2(tmp_path / "erf", activation_function="gelu")
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    config["rope_scaling"] = config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e3}
    (scaled / "config.json").write_text(json.dumps(config))
    (scaled / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    cases = {
        "meta-llama/Llama-3-8B": "does not exist; trainmesh never downloads",
        str(bin_only): "pytorch_model.bin (a pickle, which trainmesh never loads)",
        str(erf): "activation_function is 'gelu'",
        str(scaled): "rope type is 'dynamic'",
    }
    capsys.readouterr()  # save_pretrained's progress bars
    for path, message in cases.items():
        assert main(["train", "--init-hf", path]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["train", "--init-hf", str(llama_dir), "--model", "llama-small"]) == 2
    assert "--model llama-small conflicts with --init-hf" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--model tiny is a gpt model"):
        validate(Config.from_settings(init_hf=str(llama_dir), model="tiny"))


def test_extra_tensors_are_refused(tmp_path):
    directory = save_hf_llama(tmp_path / "hf")
    tensors = load_file(directory / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, directory / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(hf.HFError, match="would not use .*q_norm"):
        hf.check_weights(directory)


# --- MixtralForCausalLM: the Llama family's mixture of experts ---------------------------------------------

def save_hf_mixtral(directory: Path, seed: int = 0) -> Path:
    """A random Mixtral (hidden 64, 2 layers, GQA, 4 experts of hidden 32, top-2) by ``save_pretrained``,
    which writes each expert's w1/w2/w3 separately."""
    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, rope_theta=5000.0,
                                     rms_norm_eps=1e-6, initializer_range=0.2, router_aux_loss_coef=0.02)
    return _save_random(transformers.MixtralForCausalLM, cfg, directory, seed)


@pytest.fixture
def fp64_mixtral(monkeypatch, fp64_llama):
    """Mixtral's RMSNorm, rotary angles and router softmax in the model's dtype (transformers computes each
    in float32), with the Llama patches' code."""
    from transformers.models.llama import modeling_llama as ml
    from transformers.models.mixtral import modeling_mixtral as mm

    def route(self, hidden):
        hidden = hidden.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden, self.weight)
        top, index = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index

    monkeypatch.setattr(mm.MixtralRMSNorm, "forward", ml.LlamaRMSNorm.forward)
    monkeypatch.setattr(mm.MixtralRotaryEmbedding, "forward", ml.LlamaRotaryEmbedding.forward)
    monkeypatch.setattr(mm.MixtralTopKRouter, "forward", route)


def mixtral_logits(directory: Path) -> torch.Tensor:
    """transformers' logits with its experts run one by one (``eager``): its default grouped_mm path refuses
    float64 on CPU."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="sdpa",
                                                              experts_implementation="eager")
    with torch.no_grad():
        return model(TOKENS).logits


def test_mixtral_conversion_round_trips_the_saved_tensors_bit_for_bit(tmp_path):
    directory = save_hf_mixtral(tmp_path / "hf")
    spec, model_config, ours = hf.read_hf(directory)
    assert spec.family == "llama-moe" and model_config.moe.n_experts == 4 and model_config.moe.top_k == 2
    assert ours["blocks.1.mlp.experts.w1"].shape == (4, 64, 32)
    saved = load_file(directory / hf.WEIGHTS)
    back = spec.hf.to_hf(model_config, ours)
    assert back.keys() == saved.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, saved[name]), name


def test_mixtral_in_through_the_training_path_and_out_again_gives_transformers_logits(tmp_path, fp64_mixtral):
    directory = save_hf_mixtral(tmp_path / "hf")
    cfg = config_from_args(_args(init_hf=str(directory), precision="fp64", progress=False))
    assert cfg.model.model == "llama-moe-tiny" and cfg.model_config.moe.d_ff_expert == 32
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    checkpoints.restore(run)
    expected = mixtral_logits(directory)
    with torch.no_grad():
        assert_same_logits(run.model(TOKENS), expected, "mixtral imported, one process")
    out = hf.save_hf(run.model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    assert_same_logits(mixtral_logits(out), expected, "mixtral exported, reloaded")
    ckpt = tmp_path / "ckpt"
    checkpoints.save(dataclasses.replace(run, cfg=cfg.replace(checkpoint_dir=str(ckpt))),
                    checkpoint.TrainingProgress(0))
    assert main(["export", str(ckpt), "--hf", str(tmp_path / "exported")]) == 0
    assert_same_logits(mixtral_logits(tmp_path / "exported"), expected, "mixtral checkpoint exported, reloaded")


def test_a_checkpoint_with_a_moved_routing_bias_is_refused_on_export_hf(tmp_path, capsys):
    """The checkpoint holds the bias --moe-bias-rate moved; Mixtral's router has no place for it."""
    directory = save_hf_mixtral(tmp_path / "hf")
    cfg = config_from_args(_args(init_hf=str(directory), precision="fp64", progress=False, moe_bias_rate=0.01,
                                 checkpoint_dir=str(tmp_path / "ckpt")))
    run = build(cfg, Mesh.build(1, 1, 1, torch.device("cpu")))
    for _, layer in moe.moe_layers(run.model):
        layer.router.expert_bias[0] = 0.01
    checkpoints.save(run, checkpoint.TrainingProgress(0))
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "exported")]) != 0
    assert "--moe-bias-rate" in capsys.readouterr().err and not (tmp_path / "exported").exists()


def test_moe_models_mixtral_cannot_hold_are_refused_on_export(tmp_path):
    shared = spec_of("llama-moe-tiny").presets["llama-moe-tiny"]
    with pytest.raises(hf.HFError, match="n_shared_experts is 1; MixtralForCausalLM has 0"):
        hf.save_hf(spec_of("llama-moe-tiny").builder(shared, 0), tmp_path / "out")
