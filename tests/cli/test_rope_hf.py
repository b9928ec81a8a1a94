"""RoPE scaling imported from and exported to Hugging Face: a random Llama with Llama 3.1's "llama3" scaling
and one with "linear", a Qwen2 with "yarn" and a DeepSeek-V3 with yarn and ``mscale``/``mscale_all_dim``,
each written by ``save_pretrained`` with ``original_max_position_embeddings`` 16 and run at 64 tokens, give
transformers' own logits once imported and once exported and reloaded (the rope config kept); the same
weights with the scaling dropped do not. A scaled Llama trained from HF keeps its scaling in the checkpoint
and its export.

In float64 to 1e-10 of the logits' scale, as ``test_families_hf.py``; the rotary angles are transformers' own
rope functions (``ROPE_INIT_FUNCTIONS``, its attention factor included) with their float32 casts made float64."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch

import test_families_hf
import test_hf
from test_families_hf import CONFIGS, SHAPE, _logits
from test_hf import _randomize, assert_same_logits
from runs import config
from trainmesh.app.cli import main
from trainmesh.app.generate import load_model
from trainmesh.app.train import train
from trainmesh.checkpoint import read_manifest, step_dir
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import hf
from trainmesh.models.rope import RopeScaling, rope_from_hf

transformers = pytest.importorskip("transformers")
fp64_llama, fp64_families = test_hf.fp64_llama, test_families_hf.fp64_families  # the fixtures, for these tests

LONG = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
ORIGINAL = dict(original_max_position_embeddings=16)
CASES = {
    "llama-llama3": ("llama", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   **ORIGINAL)),
    "llama-linear": ("llama", dict(rope_type="linear", factor=2.0)),
    "qwen2-yarn": ("qwen2", dict(rope_type="yarn", factor=4.0, **ORIGINAL)),
    "deepseek-v3-yarn": ("deepseek-v3", dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                                             **ORIGINAL)),
}
BUILDERS = {**CONFIGS, "llama": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)}


@pytest.fixture
def fp64_rope(monkeypatch, fp64_families):
    """Each family's rotary angles from transformers' own rope function of its config, in float64."""
    from transformers import modeling_rope_utils
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    in_float64 = types.SimpleNamespace(**{**vars(torch), "float": torch.float64, "float32": torch.float64})

    def rotary(self, x, position_ids):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(modeling_rope_utils, "torch", in_float64)
            inv_freq, factor = modeling_rope_utils.ROPE_INIT_FUNCTIONS[self.rope_type](self.config)
        angles = position_ids[..., None].to(x.dtype) * inv_freq.to(x.dtype)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * factor, angles.sin() * factor

    for module, prefix in ((modeling_llama, "Llama"), (modeling_qwen2, "Qwen2"), (modeling_deepseek_v3, "DeepseekV3")):
        monkeypatch.setattr(getattr(module, f"{prefix}RotaryEmbedding"), "forward", rotary)


def save_scaled(name: str, scaling: dict, directory: Path, seed: int = 0) -> Path:
    """A random float64 model of family ``name`` whose config has rope parameters ``scaling``, saved."""
    torch.manual_seed(seed)
    hf_config = BUILDERS[name]()
    hf_config.rope_parameters = {**scaling, "rope_theta": SHAPE["rope_theta"]}
    model = transformers.AutoModelForCausalLM.from_config(hf_config).double()
    _randomize(model, seed)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("case", list(CASES))
def test_a_scaled_rope_imports_and_exports_with_transformers_logits(tmp_path, fp64_rope, case):
    name, scaling = CASES[case]
    directory = save_scaled(name, scaling, tmp_path / "hf")
    spec, model_config, _ = hf.read_hf(directory)
    assert spec.family == name and model_config.rope_scaling == RopeScaling(**scaling)
    expected = _logits(directory, LONG)
    model = hf.load_hf(spec.builder(model_config, 7).double(), directory)
    unscaled = spec.builder(dataclasses.replace(model_config, rope_scaling=None), 7).double()
    unscaled.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_same_logits(model(LONG), expected, f"{case} imported, one process")
        with pytest.raises(AssertionError, match="exceeds"):
            assert_same_logits(unscaled(LONG), expected, f"{case} without its scaling")
    out = hf.save_hf(model, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert rope_from_hf(written) == (SHAPE["rope_theta"], model_config.rope_scaling)
    assert_same_logits(_logits(out, LONG), expected, f"{case} exported, reloaded")


def test_a_llama3_scaled_llama_trains_from_hf_and_exports_its_scaling(tmp_path, fp64_rope):
    """The manifest records the scaling (and reads it back), so the trained checkpoint, loaded or exported
    with ``export --hf``, gives transformers' logits with it."""
    name, scaling = CASES["llama-llama3"]
    directory, ckpt, out = save_scaled(name, scaling, tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "out"
    train(config(init_hf=str(directory), model="llama-tiny", precision="fp64", steps=1, global_batch=2, seq_len=64,
                 warmup_steps=0, checkpoint_dir=str(ckpt)), Mesh.build(1, 1, 1, torch.device("cpu")))
    step = step_dir(ckpt, 1)
    assert read_manifest(step)["model"]["rope_scaling"]["rope_type"] == "llama3"
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    model, _ = load_model(step, torch.device("cpu"))
    assert model.cfg.rope_scaling == RopeScaling(**scaling)
    with torch.no_grad():
        assert_same_logits(model(LONG), _logits(out, LONG), "llama3 trained from HF, exported")
