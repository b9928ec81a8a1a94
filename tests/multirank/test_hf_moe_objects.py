"""transformers objects that ``tm.parallelize`` converts to their trainmesh family (``tm.from_hf``): the MoE
ones, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``DeepseekV3ForCausalLM`` (latent attention, a sigmoid
router with a random selection bias, a shared expert, a dense first layer) and ``GptOssForCausalLM`` with their
experts split over ep, ``Gemma3ForCausalLM`` at tp2 (tied), Qwen3-MoE at pp2 (slow: Qwen3-MoE and DeepSeek-V3 at
tp2 x ep2 SP, Mixtral at pp2 x ep2), train as the same object trained by transformers alone with
torch.optim.AdamW in one process (float64, 1e-9); ``tm.from_hf(dir)`` gives transformers' logits for its folder
(1e-10 of their scale). transformers' float32 islands (RMSNorm, rotary angles, the routers) run in the model's
dtype on the reference side, as in tests/cli/test_hf.py; the router's aux loss is off (coefficient 0) on both
sides, transformers adding it only with ``output_router_logits``."""

import types

import pytest
import torch
import torch.nn.functional as F

import test_gemma3
import test_gpt_oss
import trainmesh as tm
from helpers import FP64_ATOL
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import hf

transformers = pytest.importorskip("transformers")
fp64_gpt_oss, fp64_gemma = test_gpt_oss.fp64_gpt_oss, test_gemma3.fp64_gemma  # the fixtures, for this module's

LR, STEPS, VOCAB = 1e-2, 3, 64


SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
CONFIGS = {
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=24, norm_topk_prob=True,
                                                     router_aux_loss_coef=0.0),
    "mixtral": lambda: transformers.MixtralConfig(**{**SHAPE, "intermediate_size": 24}, num_local_experts=4,
                                                  num_experts_per_tok=2, router_aux_loss_coef=0.0),
    "deepseek-v3": lambda: transformers.DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=4),
    # Sinks, biases, a 4-token window on alternate layers of 16-token sequences, a clamp that binds, YaRN.
    "gpt-oss": lambda: transformers.GptOssConfig(
        **{**SHAPE, "intermediate_size": 24}, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, swiglu_limit=0.5, router_aux_loss_coef=0.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32.0, beta_slow=1.0, truncate=False)),
    # Dense and tied: local layers (window 4) and a global one with its own rope base, q/k norms, GeGLU. No pad
    # token: transformers' embedding would keep its row's lookup gradient out (padding_idx), trainmesh's does not.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3}, head_dim=16, sliding_window=4, query_pre_attn_scalar=12, pad_token_id=None,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}),
}
ATTENTION = {"gpt-oss": "eager"}  # transformers' sdpa path has no sinks


def hf_moe(name: str = "qwen3-moe") -> torch.nn.Module:
    """A random float64 transformers model of architecture ``name`` (DeepSeek-V3's selection bias random too)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[name](), attn_implementation=ATTENTION.get(name, "sdpa"), experts_implementation="eager").double()
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):  # a bias that changes which experts win
            buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(0), dtype=buffer.dtype))
        if buffer_name.endswith("embed_scale"):  # Gemma's sqrt(hidden), made a float32 tensor before .double()
            buffer.fill_(model.config.hidden_size ** 0.5)
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (4, 17), generator=g) for _ in range(STEPS)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.fixture
def fp64_islands(monkeypatch, fp64_gpt_oss, fp64_gemma):
    """transformers' RMSNorms, rotary angles and routers in the model's dtype, not float32 (GPT-OSS's and Gemma 3's:
    their own tests' fixtures)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
    from transformers.models.mixtral import modeling_mixtral as mm
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        dim = self.inv_freq.numel() * 2
        theta = (getattr(self.config, "rope_parameters", None) or {}).get("rope_theta") or self.config.rope_theta
        angles = position_ids[..., None].to(x.dtype) * theta ** -(torch.arange(0, dim, 2, dtype=x.dtype) / dim)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def route(self, hidden):
        logits = F.linear(hidden.reshape(-1, self.hidden_dim), self.weight)
        top, index = logits.softmax(-1).topk(self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True) if getattr(self, "norm_topk_prob", True) else top, index

    sigmoid_route, in_float64 = ds.DeepseekV3TopkRouter.forward, types.SimpleNamespace(
        **{**vars(torch), "float32": torch.float64})

    def deepseek_route(self, hidden):  # transformers' own DeepSeek-V3 router, its float32 casts made float64
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ds, "torch", in_float64)
            return sigmoid_route(self, hidden)

    for module, prefix in ((qm, "Qwen3Moe"), (mm, "Mixtral"), (ds, "DeepseekV3")):
        monkeypatch.setattr(getattr(module, f"{prefix}RMSNorm"), "forward", rms_norm)
        monkeypatch.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", rotary)
    monkeypatch.setattr(qm.Qwen3MoeTopKRouter, "forward", route)
    monkeypatch.setattr(mm.MixtralTopKRouter, "forward", route)
    monkeypatch.setattr(ds.DeepseekV3TopkRouter, "forward", deepseek_route)


def transformers_alone(tmp_path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The object trained by its own forward and torch.optim.AdamW (decaying matrices only, as trainmesh does);
    its final weights read back under trainmesh's names through the family's mapping."""
    model = hf_moe(name)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(model(x).logits.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(tmp_path / "trained")
    return losses, hf.read_hf(tmp_path / "trained")[2]


def through_parallelize(name: str, mesh: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    pm = tm.parallelize(hf_moe(name), tm.init_mesh(**mesh), sequence_parallel=mesh.get("sequence_parallel", False),
                        precision="fp64")
    opt = tm.optimizer(pm, lr=LR)
    losses = [tm.train_step(pm, opt, batch) for batch in batches()]
    return losses, pm.state_dict()


def _case(name: str, world: int, slow: bool = False, **mesh):
    """A parameter set named ``name-layout`` (``gemma3-tp2``), in the slow set when ``slow``."""
    layout = "-".join(f"{k}{v}" for k, v in mesh.items() if k != "sequence_parallel")
    layout += "-sp" if mesh.get("sequence_parallel") else ""
    return pytest.param(name, mesh, world, id=f"{name}-{layout}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("name, mesh, world", [
    _case("qwen3-moe", 2, ep=2), _case("mixtral", 2, ep=2), _case("deepseek-v3", 2, ep=2), _case("gpt-oss", 2, ep=2),
    _case("gemma3", 2, tp=2), _case("qwen3-moe", 2, pp=2),
    _case("qwen3-moe", 4, True, tp=2, ep=2, sequence_parallel=True),
    _case("deepseek-v3", 4, True, tp=2, ep=2, sequence_parallel=True), _case("mixtral", 4, True, pp=2, ep=2)])
def test_a_converted_transformers_object_trains_through_parallelize_as_transformers_alone(tmp_path, fp64_islands,
                                                                                         name, mesh, world):
    losses, params = run_ranks(through_parallelize, world, name, mesh, timeout=300)[0]
    ref_losses, ref_params = transformers_alone(tmp_path, name)
    assert ref_params.keys() <= params.keys()  # and the routers' (unused) selection biases
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    param_diff = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
    print(f"{name} {mesh}: |dloss| {loss_diff:.1e} |dparam| {param_diff:.1e}")
    assert loss_diff <= FP64_ATOL and param_diff <= FP64_ATOL, (loss_diff, param_diff)
    assert max(abs(a - b) for a, b in zip(ref_losses, ref_losses[1:])) > 1e-3  # it trained


def test_from_hf_gives_transformers_logits_and_maps_back_and_refuses_a_missing_folder(tmp_path, fp64_islands):
    """A folder's and an object's conversions give transformers' logits; ``save_hf`` of the converted model's
    state dict (buffers included, as ``pm.state_dict()`` gives it) is a folder transformers reads the same."""
    model = hf_moe()
    model.save_pretrained(tmp_path / "hf")
    x = batches()[0][0]
    with torch.no_grad():
        theirs = model(x).logits
        ours = tm.from_hf(tmp_path / "hf")
        hf.save_hf(tm.from_hf(model).state_dict(), tmp_path / "back", ours.cfg)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float64,
                                                                 experts_implementation="eager")
        for what, logits in (("from_hf(dir)", ours(x)), ("from_hf(object), save_hf", back(x).logits)):
            diff, scale = (logits - theirs).abs().max().item(), theirs.abs().max().item()
            print(f"{what}: max |dlogit| {diff:.1e} of {scale:.2f}")
            assert scale > 1.0 and diff <= 1e-10 * scale, what
    assert next(ours.parameters()).dtype == torch.float64
    with pytest.raises(ValueError, match="does not exist; trainmesh never downloads") as e:
        tm.from_hf(tmp_path / "missing")
    assert "\n" not in str(e.value)
