"""A family of one's own through ``tm.register_family``: the example registers one and trains it under
``trainmesh launch`` with no plan or layout passed; clashing registrations and Hugging Face models of no
family are refused in one line, before any weight is touched."""

import dataclasses
import runpy
import sys

import pytest
import torch

import trainmesh as tm
from trainmesh import models
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import llama

from test_api import ROOT, launch


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for the test to add to, so no other test sees its families."""
    monkeypatch.setattr(models, "SPECS", list(models.SPECS))
    return models.SPECS


def _spec(**changes) -> tm.ModelSpec:
    base = tm.ModelSpec("mine", {"mine-tiny": llama.PRESETS["llama-tiny"]}, llama.Llama, llama.TP_PLAN, {},
                        llama.LlamaConfig.shape, accepts=lambda model: False)
    return dataclasses.replace(base, **changes)


def test_a_registered_familys_presets_become_model_names(registry):
    spec = tm.register_family(_spec())
    assert models.spec_of("mine-tiny") is spec and "mine-tiny" in models.PRESET_NAMES
    assert tm.register_family(spec) is spec and registry.count(spec) == 1  # again: a no-op


@pytest.mark.parametrize("changes,message", [
    (dict(family="llama"), "^model family 'llama' exists; give the ModelSpec another family name$"),
    (dict(presets={"qwen3-tiny": None}), "^model preset 'qwen3-tiny' exists in another family; rename the preset$"),
    (dict(hf=llama.HF_MAPPING), "^LlamaForCausalLM is read by trainmesh's own family"),
])
def test_clashing_registrations_are_refused_in_one_line(registry, changes, message):
    with pytest.raises(ValueError, match=message):
        tm.register_family(_spec(**changes))


def test_a_hugging_face_model_of_no_family_is_refused_before_its_weights_are_touched():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^GPTNeoXForCausalLM \(gpt_neox\) is of no registered trainmesh family: "
                                         r"its forward returns .*tm.register_family"):
        tm.parallelize(model, Mesh.build(1, 1, 1, torch.device("cpu")))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model(torch.zeros(1, 4, dtype=torch.long))  # still the user's, runnable


def test_the_own_family_example_registers_and_trains_in_one_process(registry, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["own_family.py", "--steps", "3"])
    runpy.run_path(str(ROOT / "examples" / "own_family.py"), run_name="__main__")
    losses = [float(line.split()[-1]) for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert models.family("token-mlp").recompute["full"][0].__name__ == "Block"


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--tp", "2"), ("--pp", "2")])
def test_the_own_family_example_trains_at_tp2_and_pp2_with_the_familys_plan_and_blocks(args):
    losses = launch("own_family.py", 2, *args, "--steps", "3")
    assert len(losses) == 3 and losses[-1] < losses[0]
