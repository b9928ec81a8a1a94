"""transformers' own Qwen2, Qwen3 (heads twice hidden / heads wide) and Mistral (its sliding window of 4 in
16-token sequences) objects through ``tm.parallelize`` with no plan or layout: recognised as families, trained
at tp2+SP as their own forward trains in plain torch (float64, 1e-9)."""

import pytest
import torch

import test_api
from helpers import FP64_ATOL
from trainmesh import models
from trainmesh.distributed.testing import run_ranks

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64)


def _build(config_class, **extra):
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config_class(**SHAPE, **extra),
                                                              attn_implementation="sdpa").double()
        with torch.no_grad():  # q/k/v biases away from 0, so a misplaced one shows
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
        return model
    return build


test_api.BUILDERS.update({"hf_qwen2": _build(transformers.Qwen2Config),
                          "hf_qwen3": _build(transformers.Qwen3Config, head_dim=32),  # twice 64 / 4, as Qwen3's
                          "hf_mistral": _build(transformers.MistralConfig, sliding_window=4)})


def _train(layouts: list[dict]) -> list:
    return test_api.train_layouts(layouts)


def test_hf_objects_of_the_families_are_recognised():
    for name, family in (("hf_qwen2", "hf-qwen2"), ("hf_qwen3", "hf-qwen3"), ("hf_mistral", "hf-mistral")):
        model = test_api.BUILDERS[name]()
        assert models.spec_for(model).family == family
    assert models.spec_for(test_api.BUILDERS["hf_mistral"]()).shape(
        test_api.BUILDERS["hf_mistral"]().config).sliding_window == 4
    qwen3 = test_api.BUILDERS["hf_qwen3"]()
    assert models.spec_for(qwen3).shape(qwen3.config).qkv_width == (4 + 2 * 2) * 32


@pytest.mark.parametrize("names", [("hf_mistral",), pytest.param(("hf_qwen2", "hf_qwen3"), marks=pytest.mark.slow)])
def test_hf_qwen2_qwen3_and_mistral_at_tp2_sp_match_plain_torch(names):
    layouts = [dict(model=name, mesh=dict(tp=2), sequence_parallel=True) for name in names]
    results = run_ranks(_train, 2, layouts, timeout=240)[0]
    for layout, (losses, params) in zip(layouts, results):
        ref_losses, ref_params = test_api.plain_torch(layout["model"])
        assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= FP64_ATOL, layout["model"]
        assert max((params[k] - ref_params[k]).abs().max().item() for k in ref_params) <= FP64_ATOL, layout["model"]
