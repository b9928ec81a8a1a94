"""A Hugging Face ``config.json`` as the planner's :class:`ModelShape`: llama, mistral, qwen2, qwen3, mixtral,
qwen3_moe, deepseek_v3 and gpt2 read with transformers' defaults but without transformers; any other model type a
registered family maps (Gemma 3, GPT-OSS, a family from a package) read as ``--init-hf`` builds it; remote code
(``auto_map``) refused; counts match ``sum(p.numel())`` (tests/unit/test_plan_shapes.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trainmesh.models import SPECS
from trainmesh.models.hf import HFError, check_config_values, family_of
from trainmesh.models.spec import HFIncompatible, ModelShape, explicit_head_dim

Config = Mapping[str, Any]


def _get(cfg: Config, key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{where} has no {key!r}, which a {cfg.get('model_type')} config needs; add it")
    return cfg[key]


def _llama_like(cfg: Config, where: str, **extra: Any) -> ModelShape:
    """Llama's layout (RMSNorm, RoPE, SwiGLU, no biases), which mistral, qwen2 and qwen3 share; heads of
    ``head_dim`` where it is given (Qwen3, Mistral-Nemo), else hidden_size / num_attention_heads."""
    d, heads = _get(cfg, "hidden_size", where), _get(cfg, "num_attention_heads", where)
    if cfg.get("mlp_bias") or cfg.get("attention_bias") and cfg.get("model_type") not in ("qwen2",):
        raise ValueError(f"{where}: attention_bias/mlp_bias put biases on every projection, which the planner's "
                         f"shapes do not count; plan it without them")
    return ModelShape(
        n_layers=_get(cfg, "num_hidden_layers", where), d_model=d, n_heads=heads,
        d_ff=_get(cfg, "intermediate_size", where), vocab_size=_get(cfg, "vocab_size", where),
        seq_len=cfg.get("max_position_embeddings") or 2048, gated_mlp=True, bias=False, learned_positions=False,
        n_kv_heads=cfg.get("num_key_value_heads") or heads, tied_embeddings=bool(cfg.get("tie_word_embeddings")),
        head_dim=explicit_head_dim(d, heads, cfg.get("head_dim")), **extra)


def _mistral(cfg: Config, where: str) -> ModelShape:
    return _llama_like(cfg, where, sliding_window=cfg.get("sliding_window"))


def _qwen2(cfg: Config, where: str) -> ModelShape:
    return _llama_like(cfg, where, qkv_bias=True)


def _qwen3(cfg: Config, where: str) -> ModelShape:
    return _llama_like(cfg, where, qk_norm=True)


def _mixtral(cfg: Config, where: str) -> ModelShape:
    """Every layer an MoE of ``num_local_experts`` SwiGLU experts of ``intermediate_size``, top
    ``num_experts_per_tok``."""
    ffn = _get(cfg, "intermediate_size", where)
    return _llama_like(cfg, where, n_experts=_get(cfg, "num_local_experts", where),
                       top_k=_get(cfg, "num_experts_per_tok", where), d_ff_expert=ffn,
                       sliding_window=cfg.get("sliding_window"))


def _qwen3_moe(cfg: Config, where: str) -> ModelShape:
    """Qwen3's attention and MoE layers of ``num_experts`` experts (no shared ones); dense layers that
    ``decoder_sparse_step``/``mlp_only_layers`` place anywhere but first are refused."""
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(f"{where}: decoder_sparse_step/mlp_only_layers interleave dense layers among the MoE ones; "
                         f"the planner's shapes hold dense layers only first")
    experts = "num_experts" if "num_experts" in cfg else "num_local_experts"  # transformers 5 writes the latter
    return _llama_like(cfg, where, qk_norm=True, n_experts=_get(cfg, experts, where),
                       top_k=_get(cfg, "num_experts_per_tok", where),
                       d_ff_expert=_get(cfg, "moe_intermediate_size", where))


def _deepseek_v3(cfg: Config, where: str) -> ModelShape:
    """Multi-head latent attention; the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the
    rest MoE of ``n_routed_experts`` experts of ``moe_intermediate_size`` plus ``n_shared_experts``."""
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{where}: moe_layer_freq={cfg['moe_layer_freq']} interleaves dense layers; the planner's "
                         f"shapes hold dense layers only first")
    heads = _get(cfg, "num_attention_heads", where)
    return ModelShape(
        n_layers=_get(cfg, "num_hidden_layers", where), d_model=_get(cfg, "hidden_size", where), n_heads=heads,
        d_ff=_get(cfg, "intermediate_size", where), vocab_size=_get(cfg, "vocab_size", where),
        seq_len=cfg.get("max_position_embeddings") or 4096, gated_mlp=True, bias=False, learned_positions=False,
        tied_embeddings=bool(cfg.get("tie_word_embeddings")), n_experts=_get(cfg, "n_routed_experts", where),
        top_k=_get(cfg, "num_experts_per_tok", where), n_shared_experts=cfg.get("n_shared_experts") or 0,
        d_ff_expert=_get(cfg, "moe_intermediate_size", where), n_dense_layers=cfg.get("first_k_dense_replace", 0),
        kv_lora_rank=_get(cfg, "kv_lora_rank", where), q_lora_rank=cfg.get("q_lora_rank") or 0,
        qk_rope_head_dim=_get(cfg, "qk_rope_head_dim", where), qk_nope_head_dim=_get(cfg, "qk_nope_head_dim", where),
        v_head_dim=_get(cfg, "v_head_dim", where), **_group_limit(cfg))


def _group_limit(cfg: Config) -> dict[str, int]:
    """DeepSeek's group-limited routing, ``topk_group`` of ``n_group`` expert groups per token, as the shape's
    ``expert_groups`` and ``groups_per_token``; nothing when every group may be picked (no limit)."""
    groups, picked = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    return {"expert_groups": groups, "groups_per_token": picked} if picked < groups else {}


def _gpt2(cfg: Config, where: str) -> ModelShape:
    """GPT-2: LayerNorm and biases everywhere, learned positions, GELU MLP of ``n_inner`` (4d), tied head."""
    d = _get(cfg, "n_embd", where)
    return ModelShape(n_layers=_get(cfg, "n_layer", where), d_model=d, n_heads=_get(cfg, "n_head", where),
                      d_ff=cfg.get("n_inner") or 4 * d, vocab_size=_get(cfg, "vocab_size", where),
                      seq_len=_get(cfg, "n_positions", where), tied_embeddings=cfg.get("tie_word_embeddings", True))


READERS: dict[str, Callable[[Config, str], ModelShape]] = {
    "llama": _llama_like, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3, "gpt2": _gpt2,
}


def shape_of_hf_config(cfg: Config, where: str = "config.json") -> ModelShape:
    """The :class:`ModelShape` of an HF config dict; one-line ValueError for what cannot be planned."""
    if cfg.get("auto_map"):
        raise ValueError(f"{where} names remote code (auto_map), which trainmesh never runs; plan the shape with "
                         f"--layers/--hidden/... flags instead")
    kind = cfg.get("model_type")
    if kind in READERS:
        return READERS[kind](cfg, where)
    return _family_shape(cfg, where)


def _family_shape(cfg: Config, where: str) -> ModelShape:
    """The shape of the model a registered family builds from ``cfg``, as ``--init-hf`` builds it: its own
    reading of the config (Gemma 3's local and global layers, GPT-OSS's sinks and expert biases), no second copy."""
    try:
        spec = family_of(cfg, where)
    except HFError:
        raise ValueError(f"{where} is model_type {cfg.get('model_type')!r}; the planner reads {', '.join(READERS)} "
                         f"and the families' types ({', '.join(_family_types())})") from None
    try:
        return spec.shape(spec.hf.from_config(cfg))
    except KeyError as e:
        raise ValueError(f"{where} has no {e}, which a {cfg.get('model_type')} config needs; give the config.json "
                         f"save_pretrained writes") from None
    except (HFIncompatible, TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(f"{where}: {e}") from None


def _family_types() -> list[str]:
    return [s.hf.model_type for s in SPECS if s.hf and s.hf.model_type not in READERS]


def read_hf_shape(directory: str | Path) -> ModelShape:
    """The shape of the HF model in ``directory`` (its ``config.json``, or the file itself)."""
    path = Path(directory)
    path = path / "config.json" if path.is_dir() else path
    try:
        cfg = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}; pass a directory holding an HF config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}); pass an HF config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds no JSON object; pass an HF config.json")
    check_config_values(cfg, path)  # what --init-hf refuses (a size of 0, a NaN scale) is refused here too
    return shape_of_hf_config(cfg, str(path))
