"""RoPE scaling's config, without models: what is refused on import (in one line naming the type or key),
what a bad scaling is told, and that each type changes the frequencies a short test sequence turns through."""

import dataclasses

import pytest
import torch

from trainmesh.checkpoint.manifest import ManifestError, _check_model_shape, _rope_scaling
from trainmesh.models import config_from_dict, preset
from trainmesh.models.rope import RopeScaling, inverse_frequencies, rope_from_hf, rope_to_hf
from trainmesh.models.spec import HFIncompatible

HF = {"max_position_embeddings": 64, "rope_theta": 5000.0}


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope type is 'dynamic'"),
    ({"type": "longrope", "short_factor": [1.0]}, "rope type is 'longrope'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5},
     "yarn rope has partial_rotary_factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "llama3 rope scaling needs original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 0.5}, "rope scaling factor is 0.5"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": "1"},
     "rope scaling's low_freq_factor is '1'; it must be a finite number"),
])
def test_what_trainmesh_does_not_compute_is_refused_in_one_line(rope, message):
    with pytest.raises(HFIncompatible, match=message) as e:
        rope_from_hf({**HF, "rope_scaling": rope})
    assert "\n" not in str(e.value)


def test_both_spellings_read_the_same_and_write_back_what_the_type_reads():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    theta, scaling = rope_from_hf({**HF, "rope_scaling": rope})
    assert (theta, scaling) == rope_from_hf({"rope_parameters": {**rope, "rope_theta": 5000.0}})
    assert rope_to_hf(scaling) == {"rope_scaling": rope} and rope_to_hf(None) == {}
    assert rope_from_hf({**HF, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 16}})[1].factor == 4


def test_each_type_changes_the_frequencies():
    base = inverse_frequencies(16, 5000.0, None, torch.float64, torch.device("cpu"))
    for scaling in (RopeScaling("linear", 2.0), RopeScaling("llama3", 8.0, 16), RopeScaling("yarn", 4.0, 16)):
        scaled = inverse_frequencies(16, 5000.0, scaling, torch.float64, torch.device("cpu"))
        assert (scaled <= base).all() and (scaled < base).any(), scaling


def test_a_manifest_keeps_the_scaling_and_refuses_a_bad_one():
    cfg = dataclasses.replace(preset("llama-tiny"), rope_scaling=RopeScaling("yarn", 4.0, 16, mscale_all_dim=1.0))
    recorded = dataclasses.asdict(cfg)
    _rope_scaling(recorded["rope_scaling"])
    assert config_from_dict(preset("llama-tiny"), recorded) == cfg
    with pytest.raises(ManifestError, match="model.rope_scaling .*rope type 'ntk'"):
        _rope_scaling({**recorded["rope_scaling"], "rope_type": "ntk"})


def test_a_manifest_keeps_gemmas_local_rope_base_and_refuses_a_bad_one():
    """A number that may be off (``local_rope_theta``, ``query_pre_attn_scalar``) is checked as a number, not
    as a sub-config: Gemma 3's checkpoints load."""
    cfg = preset("gemma3-tiny")
    recorded = dataclasses.asdict(cfg)
    _check_model_shape(recorded, cfg, "family gemma3")
    _check_model_shape({**recorded, "local_rope_theta": None}, cfg, "family gemma3")
    with pytest.raises(ManifestError, match="model.local_rope_theta is -1.0; it must be a finite number above 0"):
        _check_model_shape({**recorded, "local_rope_theta": -1.0}, cfg, "family gemma3")
