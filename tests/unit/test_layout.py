"""One layout, checked once: every refusal of :func:`trainmesh.layout.validate` reaches the user in one line
through both front doors, naming the flag on the command line (``trainmesh train``) and the keyword in the
Python API (``trainmesh.parallelize`` on a one-process mesh). Pure logic: no rank is spawned, except one
``trainmesh train`` run as a command, for the traceback the interleaved schedule used to print."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

import trainmesh as tm
from trainmesh.app import cli
from trainmesh.distributed import launcher
from trainmesh.layout import Layout, LayoutError, flag, keyword, validate
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import preset, spec_of
from trainmesh.models.spec import ModelShape


@dataclass(frozen=True)
class Refusal:
    """One bad layout, as flags and as API arguments, and the setting each message must name."""

    flags: tuple[str, ...]
    names_flag: str
    mesh: dict[str, int] = field(default_factory=dict)
    kwargs: dict[str, object] = field(default_factory=dict)
    names_keyword: str = ""
    model: str = "tiny"
    seq_len: int = 0  # 0: the preset's


REFUSALS = {
    "interleaved without virtual stages": Refusal(
        ("--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--microbatches", "2"), "--virtual-stages",
        dict(pp=2), dict(schedule="interleaved", microbatches=2), "virtual_stages"),
    "virtual stages without interleaved": Refusal(
        ("--nproc", "2", "--pp", "2", "--virtual-stages", "2"), "--virtual-stages 2",
        dict(pp=2), dict(virtual_stages=2), "virtual_stages=2"),
    "virtual stages without a pipeline": Refusal(
        ("--virtual-stages", "2"), "--virtual-stages", {}, dict(virtual_stages=2), "virtual_stages"),
    "sequence parallel with tp 1": Refusal(
        ("--sequence-parallel",), "--sequence-parallel", {}, dict(sequence_parallel=True), "sequence_parallel"),
    "sequence parallel that cannot split the sequence": Refusal(
        ("--nproc", "4", "--tp", "4", "--sequence-parallel", "--seq-len", "30"), "--sequence-parallel",
        dict(tp=4), dict(sequence_parallel=True), "sequence_parallel", seq_len=30),
    "ep not dividing dp*cp": Refusal(
        ("--model", "moe-tiny", "--nproc", "2", "--dp", "2", "--ep", "4"), "--ep 4",
        dict(dp=2, ep=4), {}, "ep=4", model="moe-tiny"),
    "ep not dividing the experts": Refusal(
        ("--model", "moe-tiny", "--nproc", "3", "--dp", "3", "--ep", "3", "--global-batch", "12"), "--ep 3",
        dict(dp=3, ep=3), {}, "ep=3", model="moe-tiny"),
    "ep on a dense model": Refusal(
        ("--nproc", "2", "--dp", "2", "--ep", "2"), "--ep 2", dict(dp=2, ep=2), {}, "ep=2"),
    "tp not dividing the heads": Refusal(("--nproc", "3", "--tp", "3"), "--tp 3", dict(tp=3), {}, "tp=3"),
    "pp beyond the layers": Refusal(("--nproc", "3", "--pp", "3"), "--pp 3", dict(pp=3), {}, "pp=3"),
    "stage layers of the wrong count": Refusal(
        ("--nproc", "2", "--pp", "2", "--stage-layers", "1,1,1"), "--stage-layers 1,1,1",
        dict(pp=2), dict(stage_layers=(1, 1, 1)), "stage_layers=(1, 1, 1)"),
    "stage layers of the wrong sum": Refusal(
        ("--model", "tiny-deep", "--nproc", "2", "--pp", "2", "--stage-layers", "3,4"), "--stage-layers 3,4",
        dict(pp=2), dict(stage_layers=(3, 4)), "stage_layers=(3, 4)", model="tiny-deep"),
    "interleaved micro-batches not a multiple of pp": Refusal(
        ("--model", "tiny-deep", "--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2",
         "--microbatches", "3", "--global-batch", "6"), "--microbatches",
        dict(pp=2), dict(schedule="interleaved", virtual_stages=2, microbatches=3), "microbatches", model="tiny-deep"),
    "zero stage 4": Refusal(("--zero", "4"), "--zero 4", {}, dict(zero=4), "zero=4"),
    "unknown recompute mode": Refusal(("--recompute", "most"), "--recompute most", {}, dict(recompute="most"),
                                      "recompute='most'"),
    "cp with the zero-bubble schedule": Refusal(
        ("--nproc", "4", "--cp", "2", "--pp", "2", "--schedule", "zb"), "--schedule zb",
        dict(cp=2, pp=2), dict(schedule="zb"), "schedule='zb'"),
    "cp with compile": Refusal(("--nproc", "2", "--cp", "2", "--compile"), "--compile",
                               dict(cp=2), dict(compile=True), "compile"),
    "zero-bubble schedule with compile": Refusal(
        ("--nproc", "2", "--pp", "2", "--schedule", "zb", "--compile"), "--compile",
        dict(pp=2), dict(schedule="zb", compile=True), "compile"),
    "cp not dividing the sequence": Refusal(
        ("--nproc", "2", "--cp", "2", "--seq-len", "30"), "--cp 2", dict(cp=2), {}, "cp=2", seq_len=30),
    "a2a with heads cp*tp does not divide": Refusal(
        ("--model", "llama-tiny", "--nproc", "4", "--cp", "2", "--tp", "2", "--cp-impl", "a2a"), "--cp-impl a2a",
        dict(cp=2, tp=2), dict(cp_impl="a2a"), "cp_impl='a2a'", model="llama-tiny"),
}


def _one_line(text: str) -> str:
    assert text and "\n" not in text.strip() and "Traceback" not in text, text
    return text.strip()


@pytest.mark.parametrize("case", REFUSALS)
def test_the_command_line_refuses_in_one_line_naming_the_flag(case, monkeypatch, capsys, tmp_path):
    def no_spawn(*_a, **_k):
        raise AssertionError("a rank was spawned for a layout that cannot run")

    monkeypatch.setattr(launcher, "launch", no_spawn)
    refusal = REFUSALS[case]
    code = cli.main(["train", *refusal.flags, "--out", str(tmp_path / "run")])
    err = _one_line(capsys.readouterr().err)
    assert code == 2 and err.startswith("trainmesh: error: ") and refusal.names_flag in err, err
    assert not (tmp_path / "run").exists()


def _model(refusal: Refusal) -> torch.nn.Module:
    cfg = preset(refusal.model)
    cfg = dataclasses.replace(cfg, seq_len=refusal.seq_len) if refusal.seq_len else cfg
    return spec_of(refusal.model).builder(cfg, 0)


def _mesh(**sizes: int) -> Mesh:
    """A mesh of these sizes seen from rank 0, built without processes: the API refuses before any
    collective, so none is needed."""
    full = {"pp": 1, "dp": 1, "cp": 1, "tp": 1, **sizes}
    return Mesh(full, {axis: 0 for axis in full}, torch.device("cpu"))


@pytest.mark.parametrize("case", REFUSALS)
def test_the_api_refuses_in_one_line_naming_the_keyword(case):
    refusal = REFUSALS[case]
    with pytest.raises(ValueError) as e:
        tm.parallelize(_model(refusal), _mesh(**refusal.mesh), **refusal.kwargs)
    assert refusal.names_keyword in _one_line(str(e.value)), str(e.value)
    assert not any(f"--{name.replace('_', '-')}" in str(e.value) for name in ("virtual_stages", "sequence_parallel"))


def test_each_rule_is_one_rule_spelled_for_each_audience():
    """The same refusal reads as flags for the command line and as keywords for the API, word for word
    otherwise."""
    bad = Layout(pp=2, schedule="interleaved", microbatches=2)
    messages = []
    for spell in (flag, keyword):
        with pytest.raises(LayoutError) as e:
            validate(bad, spell=spell)
        messages.append(str(e.value))
    assert messages == [
        "--schedule interleaved runs several model chunks per pipeline rank; set --virtual-stages >= 2 "
        "(e.g. --virtual-stages 2) or use another schedule",
        "schedule='interleaved' runs several model chunks per pipeline rank; set virtual_stages >= 2 "
        "(e.g. virtual_stages=2) or use another schedule"]


WORLD_RULES = [
    (Layout(dp=4), 2, "world size 2 != dp*cp*tp*pp = 4*1*1*1 = 4"),
    (Layout(dp=2, cp=2, tp=2), 4, "world size 4 != dp*cp*tp*pp = 2*2*2*1 = 8"),
]


@pytest.mark.parametrize("layout,world,message", WORLD_RULES, ids=[m for *_, m in WORLD_RULES])
def test_the_world_must_be_the_meshs_product(layout, world, message):
    with pytest.raises(LayoutError) as e:
        validate(layout, world_size=world, spell=flag)
    assert str(e.value).startswith(f"{message}; launch {layout.world} rank(s) (--nproc {layout.world})")
    with pytest.raises(LayoutError) as e:
        validate(layout, world_size=world)
    assert f"(trainmesh launch --nproc {layout.world} or torchrun" in str(e.value)
    validate(layout, world_size=layout.world)


def test_init_mesh_refuses_a_mesh_larger_than_the_world():
    with pytest.raises(ValueError, match=r"^world size 1 != dp\*cp\*tp\*pp = 1\*1\*2\*1 = 2; launch 2 rank"):
        tm.init_mesh(tp=2)


def test_model_rules_read_the_shape_and_name_the_model():
    shape = ModelShape(n_layers=4, d_model=64, n_heads=4, d_ff=256, vocab_size=256, seq_len=32, n_kv_heads=2)
    validate(Layout(tp=2, pp=4), shape)
    with pytest.raises(LayoutError, match=r"^--tp 4 exceeds n_kv_heads=2 of mine .*; choose tp in \{1, 2\}$"):
        validate(Layout(tp=4), shape, spell=flag, name="mine")
    with pytest.raises(LayoutError, match=r"^pp=2 x virtual_stages=4 = 8 stages exceed the 4 layers"):
        validate(Layout(pp=2, virtual_stages=4, schedule="interleaved", microbatches=2), shape)
    validate(Layout(pp=8), None)  # without a shape only the settings themselves are checked


def test_the_interleaved_schedule_without_virtual_stages_is_one_line_from_the_shell(tmp_path):
    """The regression: the planner's memory check met the layout before validation did and printed a
    20-line traceback ending in ``virtual > 1 goes with schedule='interleaved'``."""
    result = subprocess.run([sys.executable, "-m", "trainmesh", "train", "--schedule", "interleaved", "--pp", "2",
                             "--nproc", "2", "--dp", "1", "--microbatches", "2", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "trainmesh: error: --schedule interleaved runs several model chunks per pipeline rank; set "
        "--virtual-stages >= 2 (e.g. --virtual-stages 2) or use another schedule"]


def test_the_layout_names_every_schedule_and_recompute_mode_the_runtime_builds():
    from trainmesh.parallel.recompute import MODES
    from trainmesh.pipeline.schedules import SCHEDULES as BUILDERS
    from trainmesh.layout import RECOMPUTE, SCHEDULES
    assert tuple(BUILDERS) == SCHEDULES and MODES == RECOMPUTE


@pytest.mark.parametrize("case", REFUSALS)
def test_the_planner_refuses_each_layout_with_the_apis_own_line(case):
    """The third front door: the planner's check of a candidate raises the very line the API raises, since both
    come from the one :func:`trainmesh.layout.validate` (only the model's name differs: the planner prices a
    shape, the API holds the module)."""
    from trainmesh.plan import Workload, check_layout

    refusal = REFUSALS[case]
    model = _model(refusal)
    with pytest.raises(ValueError) as api:
        tm.parallelize(model, _mesh(**refusal.mesh), **refusal.kwargs)
    shape = spec_of(refusal.model).shape(spec_of(refusal.model).config_of(model))
    layout = Layout(**{**refusal.mesh, **refusal.kwargs})
    microbatches = layout.microbatches * layout.dp
    with pytest.raises(LayoutError) as planner:
        check_layout(Workload(shape, microbatches, shape.seq_len), layout)
    assert _one_line(str(planner.value)) == str(api.value).replace(type(model).__name__, "the model"), (
        str(planner.value), str(api.value))


def test_expert_tensor_parallelism_must_fit_in_the_ranks_holding_different_tokens() -> None:
    """ep x etp split the token ranks; a product that does not divide them is refused in one line naming both."""
    validate(Layout(dp=4, ep=2, etp=2))
    with pytest.raises(LayoutError, match=r"ep=2 x etp=2 does not divide the 2 ranks .* choose ep\*etp in \{1, 2\}"):
        validate(Layout(dp=2, ep=2, etp=2))
    assert Layout(dp=8, ep=2, etp=2).expert_data_ranks == 2 and Layout(dp=4, tp=2, etp=2).ep_span == 4
    with pytest.raises(LayoutError, match=r"etp=2 splits the hidden width of each routed expert, and .* has no routed"):
        validate(Layout(dp=2, etp=2), spec_of("tiny").shape(preset("tiny")))
    with pytest.raises(LayoutError, match=r"etp=128 .* has experts 64 wide; choose etp in \{1, 2, 4, 8, 16, 32, 64\}"):
        validate(Layout(dp=128, etp=128), spec_of("moe-tiny").shape(preset("moe-tiny")))
