"""FP8 training (``--precision fp8``): which linears torchao makes float8, the one-line refusals, the loss
against bf16's noise floor on CPU (torchao's float8 runs there in torch 2.13), checkpoints a bf16 run loads,
and the planner's bytes and peaks."""

import importlib.util
import json

import pytest
import torch
from torch import nn

from trainmesh.training import float8
from trainmesh.app.config import Config, ConfigError, validate
from trainmesh.app.train import train
from trainmesh.distributed.hardware import DEVICE_PEAKS, make_cluster
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import preset, spec_of
from trainmesh.training.state_bytes import precision_bytes

from runs import config


torchao = pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


def _kinds(name: str) -> tuple[list[str], list[str]]:
    """(float8 linears, plain linears) of preset ``name`` after the swap, by module name."""
    spec = spec_of(name)
    model = spec.builder(preset(name), 0).to(torch.bfloat16)
    converted = float8.convert_to_float8(model, spec.high_precision)
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert fp8 == converted
    return fp8, plain


@pytest.mark.parametrize("name, moe", [("tiny", False), ("llama-tiny", False), ("moe-tiny", True),
                                       ("llama-moe-tiny", True)])
def test_the_block_linears_become_float8_and_the_family_keeps_embedding_head_and_router(name, moe):
    model = spec_of(name).builder(preset(name), 0)
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    routers = [n for n in linears if ".mlp.router." in n]
    assert bool(routers) == moe
    fp8, plain = _kinds(name)
    assert plain == routers + ["head"]
    assert fp8 == [n for n in linears if n.startswith("blocks.") and n not in routers]


def test_a_linear_not_aligned_for_scaled_mm_stays_bf16():
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 20))
    assert float8.float8_targets(model, ()) == ["0"]


def test_fp8_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    assert float8.fp8_problem(None) is None and float8.fp8_problem((9, 0)) is None
    assert float8.fp8_problem((8, 0)) == ("--precision fp8 needs FP8 tensor cores (compute capability 8.9+: L4, "
                                          "L40S, H100, H200); this GPU is 8.0; use bf16")
    with pytest.raises(ConfigError, match="^--precision fp8 needs FP8 tensor cores .* this GPU is 8.0; use bf16$"):
        validate(config(precision="fp8", device="auto"), cuda_devices=1, cuda_capability=(8, 0))
    validate(config(precision="fp8", device="cpu"), cuda_devices=1, cuda_capability=(8, 0))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    with pytest.raises(ConfigError, match=r"^--precision fp8 .* torchao.* not installed; pip install 'trainmesh\[fp8\]'$"):
        validate(config(precision="fp8"))


def test_the_api_refuses_fp8_for_a_model_whose_family_names_no_bf16_layers():
    import trainmesh as tm

    mesh = Mesh.build(1, 1, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^precision='fp8' needs the model's family .* Sequential has none"):
        tm.parallelize(nn.Sequential(nn.Linear(16, 16)), mesh, precision="fp8")


def _losses(precision: str, **kw) -> list[float]:
    torch.set_num_threads(1)
    return train(config(precision=precision, **kw), mesh=Mesh.build(1, 1, 1, torch.device("cpu"))).losses


def test_fp8_tracks_fp32_within_sixteen_times_bf16s_distance_and_differs_from_bf16():
    """e4m3's unit roundoff (2^-4) is 16 times bf16's (2^-8), so fp8's per-step distance to fp32 is held to
    16 times bf16's, measured here on the same run; fp8 must also differ from bf16 (the swap took effect),
    and end within 1 % of its loss (the GPU check's bar at step 30)."""
    fp32, bf16, fp8 = (_losses(p, steps=6) for p in ("fp32", "bf16", "fp8"))
    floor = sum(abs(a - b) for a, b in zip(bf16, fp32)) / len(fp32)
    gap = sum(abs(a - b) for a, b in zip(fp8, fp32)) / len(fp32)
    assert 0 < floor and gap < 16 * floor, (floor, gap)
    assert fp8 != bf16
    assert abs(fp8[-1] - bf16[-1]) < 0.01 * bf16[-1]


def test_an_fp8_checkpoint_holds_fp32_masters_under_the_plain_names_and_a_bf16_run_resumes_it(tmp_path):
    _losses("fp8", steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    tensors = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())["tensors"]
    model = {k.removeprefix("model/"): v["dtype"] for k, v in tensors.items() if k.startswith("model/")}
    plain = spec_of("tiny").builder(preset("tiny"), 0)
    assert model == {name: "float32" for name, _ in plain.named_parameters()}
    assert len(_losses("bf16", steps=3, checkpoint_dir=str(tmp_path), resume=True)) == 1


def test_the_planner_prices_fp8_state_as_bf16_and_knows_the_fp8_peaks():
    assert precision_bytes("fp8", "fp32") == precision_bytes("bf16", "fp32")
    assert DEVICE_PEAKS["H100"].at("fp8") == 1979e12 and DEVICE_PEAKS["H100"].at("bf16") == 989e12
    assert DEVICE_PEAKS["H200"].at("fp8") == 1979e12 and DEVICE_PEAKS["A100"].at("fp8") == 0
    h100, a100 = make_cluster("h100-80gb", 8), make_cluster("a100-80gb", 8)
    assert (h100.peak_at("fp8"), h100.peak_at("bf16"), h100.peak_at("fp64")) == (1979e12, 989e12, 67e12)
    assert a100.peak_at("fp8") == 0
    assert Config().replace(precision="fp8").layout.precision == "fp8"
