"""The public API on modules trainmesh did not write: a ``transformers.LlamaForCausalLM`` and a user's own
``nn.Module`` train through ``trainmesh.parallelize``/``optimizer``/``train_step`` at dp2, ZeRO-3, tp2 with
SP, pp2 (1F1B) and dp2 x tp2 exactly as a plain single-process PyTorch loop trains them (float64, per-step
loss and final parameters within FP64_ATOL); settings that cannot run are refused before any work; the
examples run under ``trainmesh launch``."""

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import trainmesh as tm
from trainmesh import checkpoint
from trainmesh.tracking import runlock
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import Staged, spec_for
from trainmesh.distributed.testing import run_ranks

from helpers import EQUIVALENCE_TABLE, FP64_ATOL

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from train_custom_module import LAYOUT, PLAN, Block, TokenMLP  # noqa: E402

LR, BETAS, WD, MAX_NORM, MICRO, STEPS = 3e-3, (0.9, 0.95), 0.1, 1.0, 2, 3


def hf_llama(layers: int = 4, **overrides) -> torch.nn.Module:
    """A tiny random-init Llama with grouped-query attention (4 heads, 2 KV heads), the same on every call."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def custom_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return TokenMLP(vocab=128).double()


BUILDERS = {"hf_llama": hf_llama, "custom": custom_module}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 128, (STEPS, 8, 17), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x) if isinstance(model, transformers.PreTrainedModel) else model(x)
    return out.logits if hasattr(out, "logits") else out


def plain_torch(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the model's own forward, torch.optim.AdamW (decaying matrices only, as trainmesh does),
    gradient accumulation over MICRO micro-batches and clip_grad_norm_, in one process."""
    model = BUILDERS[name]()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=1e-8)
    losses = []
    for x, y in batches():
        total = 0.0
        for xs, ys in zip(x.chunk(MICRO), y.chunk(MICRO)):
            logits = logits_of(model, xs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1)) / MICRO
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_layout(layout: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One layout through the public API, as a user script writes it."""
    layout = dict(layout)
    mesh = tm.init_mesh(**layout.pop("mesh"))
    model = tm.parallelize(BUILDERS[layout.pop("model")](), mesh, precision="fp64", microbatches=MICRO, **layout)
    opt = tm.optimizer(model, lr=LR, betas=BETAS, weight_decay=WD)
    losses = [tm.train_step(model, opt, batch, max_norm=MAX_NORM) for batch in batches()]
    return losses, model.state_dict()


def train_layouts(layouts: list[dict]) -> list:
    torch.set_num_threads(1)
    return [train_layout(layout) for layout in layouts]


def describe(layout: dict) -> str:
    parts = [f"{k}{v}" for k, v in layout["mesh"].items()] + (["sp"] if layout.get("sequence_parallel") else [])
    parts += [f"zero{layout['zero']}"] if layout.get("zero") else []
    parts += [layout["schedule"]] if "schedule" in layout else []
    return " ".join(parts + ["api", layout["model"]])


def assert_layouts_match_plain_torch(layouts: list[dict], world: int) -> None:
    results = run_ranks(train_layouts, world, layouts, timeout=240)[0]
    references = {name: plain_torch(name) for name in {layout["model"] for layout in layouts}}
    for layout, (losses, params) in zip(layouts, results):
        ref_losses, ref_params = references[layout["model"]]
        assert params.keys() == ref_params.keys(), f"{describe(layout)}: names differ {params.keys() ^ ref_params.keys()}"
        loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        param_diff = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
        assert loss_diff <= FP64_ATOL, f"{describe(layout)}: losses {losses} vs plain torch {ref_losses}"
        assert param_diff <= FP64_ATOL, f"{describe(layout)}: parameters differ by {param_diff}"
        EQUIVALENCE_TABLE.append((describe(layout), loss_diff, param_diff))


def test_hf_llama_and_a_custom_module_at_dp2_zero3_tp2_sp_pp2_match_plain_torch():
    assert_layouts_match_plain_torch([
        dict(model="hf_llama", mesh=dict(dp=2)),
        dict(model="hf_llama", mesh=dict(dp=2), zero=3, recompute="full"),
        dict(model="hf_llama", mesh=dict(tp=2), tp_plan=tm.tp_plans.llama, sequence_parallel=True),
        dict(model="hf_llama", mesh=dict(pp=2), schedule="1f1b"),
        dict(model="custom", mesh=dict(pp=2), pipeline=LAYOUT, recompute=(Block,)),
        dict(model="custom", mesh=dict(tp=2), tp_plan=PLAN, sequence_parallel=True),
    ], world=2)


def test_hf_llama_at_dp2_tp2_matches_plain_torch():
    assert_layouts_match_plain_torch([dict(model="hf_llama", mesh=dict(dp=2, tp=2), tp_plan=tm.tp_plans.llama)], world=4)


@pytest.mark.slow
def test_hf_llama_at_more_layouts_matches_plain_torch():
    assert_layouts_match_plain_torch([
        dict(model="hf_llama", mesh=dict(dp=2, pp=2), zero=1, schedule="1f1b"),
        dict(model="hf_llama", mesh=dict(tp=2, pp=2), tp_plan=tm.tp_plans.llama, sequence_parallel=True, zero=2),
        dict(model="hf_llama", mesh=dict(dp=2, tp=2), tp_plan=tm.tp_plans.llama, zero=3, recompute="selective"),
        dict(model="hf_llama", mesh=dict(pp=2, dp=2), schedule="interleaved", virtual_stages=2),
        dict(model="hf_llama", mesh=dict(pp=2, dp=2), schedule="zb"),
    ], world=4)


def save_at_tp2_sp_then_load_at_pp2(directory: str) -> tuple[list[float], list[float], int]:
    """Train two steps at tp2 with SP, save, take a third step; load the checkpoint at pp2 and take the same
    third step there. Returns both third-step losses and the step the load reported."""
    torch.set_num_threads(1)
    first = batches()
    tp = tm.parallelize(hf_llama(), tm.init_mesh(tp=2), tp_plan=tm.tp_plans.llama, sequence_parallel=True,
                        precision="fp64", microbatches=MICRO, zero=1)
    opt = tm.optimizer(tp, lr=LR)
    for batch in first[:2]:
        tm.train_step(tp, opt, batch, max_norm=MAX_NORM)
    tm.save(tp, opt, directory, step=2)
    after_tp = tm.train_step(tp, opt, first[2], max_norm=MAX_NORM)
    torch.manual_seed(1)  # another init: everything must come from the checkpoint
    config = hf_llama().config
    pp = tm.parallelize(transformers.LlamaForCausalLM(config).double(), tm.init_mesh(pp=2), precision="fp64",
                        microbatches=MICRO)
    opt = tm.optimizer(pp, lr=LR)
    step = tm.load(pp, opt, directory)
    after_pp = tm.train_step(pp, opt, first[2], max_norm=MAX_NORM)
    return after_tp, after_pp, step


def test_a_checkpoint_saved_at_tp2_sp_zero1_resumes_at_pp2(tmp_path):
    after_tp, after_pp, step = run_ranks(save_at_tp2_sp_then_load_at_pp2, 2, str(tmp_path), timeout=240)[0]
    assert step == 2
    assert abs(after_tp - after_pp) <= FP64_ATOL, f"step 3 after resharding: {after_pp} vs {after_tp}"


# --- without processes --------------------------------------------------------------------------------

def mesh_of(**sizes: int) -> Mesh:
    """A mesh of these sizes seen from rank 0, for checks that refuse a layout before any collective."""
    full = {"pp": 1, "dp": 1, "cp": 1, "tp": 1, **sizes}
    return Mesh(full, {a: 0 for a in full}, torch.device("cpu"))


def test_staged_llama_keeps_the_model_names_and_its_forward():
    model = hf_llama(layers=2)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=x).logits
    names = [n for n, _ in model.named_parameters()]
    spec = spec_for(model)
    staged = Staged(model, spec.layout(model))
    spec.prepare(staged)
    assert [n for n, _ in staged.named_parameters()] == names
    assert torch.equal(staged(x), expected)
    staged.embed = None
    assert staged.model.embed_tokens is None and staged.embed is None


def test_tp_beyond_the_kv_heads_is_refused_in_one_line_before_any_work():
    model = hf_llama(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"tp=4 exceeds n_kv_heads=2 .*choose tp in \{1, 2\}") as e:
        tm.parallelize(model, mesh_of(tp=4), tp_plan=tm.tp_plans.llama)
    assert "\n" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.parametrize("kwargs, message", [
    (dict(mesh=dict(tp=2)), r"tp=2 needs a tp_plan"),
    (dict(mesh=dict(pp=2)), r"pp=2 needs to know where TokenMLP keeps its blocks"),
    (dict(mesh=dict(pp=2), pipeline=tm.StageLayout(blocks="layers", pre="embed", post=("norm", "head"))),
     r"give StageLayout\(hidden_size=...\)"),
    (dict(mesh={}, recompute="full"), r"pass the block classes instead"),
    (dict(mesh={}, zero=4), r"zero=4: choose 0, 1, 2 or 3"),
    (dict(mesh=dict(pp=2), schedule="interleaved", virtual_stages=2, microbatches=3, pipeline=LAYOUT),
     r"set microbatches to a multiple of 2"),
    (dict(mesh={}, pipeline=tm.StageLayout(blocks="blocks")), r"names 'blocks' as the blocks, but the model"),
])
def test_a_custom_module_with_settings_that_cannot_run_is_refused(kwargs, message):
    mesh = mesh_of(**kwargs.pop("mesh"))
    with pytest.raises(ValueError, match=message):
        tm.parallelize(TokenMLP(), mesh, **kwargs)


def test_an_attention_that_needs_a_mask_is_refused():
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        tm.parallelize(hf_llama(layers=2, attn_implementation="eager"), mesh_of())


def test_single_process_api_needs_no_environment_and_a_custom_loss_reads_whole_logits():
    mesh = tm.init_mesh()
    assert mesh.world_size == 1
    with pytest.raises(ValueError, match=r"world size 1 != dp\*cp\*tp\*pp = 2\*1\*1\*1 = 2; launch 2 rank"):
        tm.init_mesh(dp=2)
    model = tm.parallelize(custom_module(), mesh, precision="fp64", microbatches=MICRO)
    opt = tm.optimizer(model, lr=LR, betas=BETAS, weight_decay=WD)
    criterion = lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # noqa: E731
    losses = [tm.train_step(model, opt, b, loss_fn=criterion, max_norm=MAX_NORM) for b in batches()]
    ref_losses, ref_params = plain_torch("custom")
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= FP64_ATOL
    assert max((v - ref_params[k]).abs().max().item() for k, v in model.state_dict().items()) <= FP64_ATOL
    with pytest.raises(ValueError, match="global batch of 5 sequences does not split"):
        tm.train_step(model, opt, (torch.zeros(5, 4, dtype=torch.long),) * 2)


def test_a_checkpoint_directory_is_held_by_the_model_saving_there_until_it_is_gone(tmp_path):
    """tm.save takes the lock trainmesh train holds on --checkpoint-dir: a directory a live run holds (a CLI
    run, another model) is refused before anything is written, naming the directory and the holder."""
    def saving() -> tuple[tm.ParallelModel, tm.Optimizer]:
        model = tm.parallelize(custom_module(), mesh_of(), precision="fp64")
        return model, tm.optimizer(model, lr=LR)

    cli_dir, directory = tmp_path / "cli", tmp_path / "api"
    cli_dir.mkdir()
    with runlock.hold(cli_dir, "--checkpoint-dir", checkpoint.LOCK) as cli_run:
        cli_run.note(run_id="0123abcd")
        with pytest.raises(checkpoint.CheckpointError, match=rf"{re.escape(str(cli_dir))} is in use by another live run: pid "
                                                             rf"{os.getpid()} on host .*, run \"0123abcd\""):
            tm.save(*saving(), cli_dir, step=1)
        assert sorted(p.name for p in cli_dir.iterdir()) == [checkpoint.LOCK]

    first, second = saving(), saving()
    tm.save(*first, directory, step=1)
    with pytest.raises(checkpoint.CheckpointError, match=f"{re.escape(str(directory))} is in use"):
        tm.save(*second, directory, step=2)
    tm.save(*first, directory, step=2)
    assert sorted(p.name for p in directory.glob("step-*")) == ["step-00000001", "step-00000002"]
    del first
    gc.collect()
    assert tm.save(*second, directory, step=3).name == "step-00000003"


def test_a_parallelized_hf_model_refuses_its_own_forward_and_state_and_saves_through_the_parallel_model(tmp_path):
    """parallelize works in place (as torchtitan and FSDP2 do): the original object's forward and state_dict
    (hence save_pretrained) would see the rewired layers, so they are refused naming what to use; its
    save_pretrained with the ParallelModel's full state writes a model transformers reloads as trained."""
    model = hf_llama(layers=1)
    x = batches()[0][0]
    parallel = tm.parallelize(model, mesh_of(), precision="fp64")
    tm.train_step(parallel, tm.optimizer(parallel, lr=LR), batches()[0])
    for use in (lambda: model(input_ids=x), lambda: model.save_pretrained(tmp_path / "refused")):
        with pytest.raises(RuntimeError, match=r"taken apart by trainmesh.parallelize .*pm.state_dict\(\)"):
            use()
    assert not list((tmp_path / "refused").glob("*.safetensors"))
    model.save_pretrained(tmp_path / "saved", state_dict=parallel.state_dict())
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float64)
    with torch.no_grad():
        assert (reloaded(input_ids=x).logits - parallel(x)).abs().max() <= FP64_ATOL


def test_hf_llama_trains_in_bf16_with_fp32_masters():
    model = tm.parallelize(hf_llama(layers=2).float(), tm.init_mesh(), precision="bf16", microbatches=MICRO)
    opt = tm.optimizer(model, lr=LR)
    assert next(model.module.parameters()).dtype is torch.bfloat16
    assert all(p.dtype is torch.float32 for g in opt.torch_optimizer.param_groups for p in g["params"])
    losses = [tm.train_step(model, opt, batches()[0], max_norm=MAX_NORM) for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


# --- the examples under trainmesh launch ----------------------------------------------------------------

def launch(script: str, nproc: int, *args: str) -> list[float]:
    """Run an example under ``trainmesh launch``; the losses rank 0 printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "trainmesh", "launch", "--nproc", str(nproc),
                          str(ROOT / "examples" / script), *args], capture_output=True, text=True, env=env,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.slow  # every example trains; the API's own default tests cover what they call
def test_the_examples_train_under_trainmesh_launch():
    losses = launch("train_hf_llama.py", 2, "--tp", "2", "--steps", "4", "--layers", "2")
    assert len(losses) == 4 and losses[-1] < losses[0]
    losses = launch("train_custom_module.py", 2, "--pp", "2", "--steps", "4")
    assert len(losses) == 4 and losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--tp", "2"), ("--pp", "2", "--zero", "1")])
def test_the_hf_llama_example_at_world_4(args):
    losses = launch("train_hf_llama.py", 4, *args, "--steps", "4")
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_launch_names_the_failing_rank_with_its_traceback(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise RuntimeError('rank one broke')\n")
    out = subprocess.run([sys.executable, "-m", "trainmesh", "launch", "--nproc", "2", str(script)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode != 0
    assert "rank 1" in out.stderr and "RuntimeError: rank one broke" in out.stderr
