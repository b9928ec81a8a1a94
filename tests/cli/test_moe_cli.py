"""Mixture-of-experts runs of the command line: the per-step expert metrics in metrics.jsonl and their report
plot, gathered over every pipeline stage as one process computes them; bad --moe-* and --ep settings refused in
one line before any rank starts; a Hugging Face Mixtral read by --init-hf at ep2."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from trainmesh.app.checkpoints import load_hf_weights
from trainmesh.app.config import Config, ConfigError, validate
from trainmesh.app.train import build, moe_metrics, setup_process, train
from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.testing import run_ranks
from trainmesh.tracking.records import scalars
from trainmesh.tracking.report import report

_cfg = functools.partial(Config.from_settings, model="moe-tiny", steps=6, warmup_steps=1, global_batch=8, progress=False,
                         tensorboard=False)


def test_moe_tiny_trains_on_one_process_and_logs_expert_metrics(tmp_path) -> None:
    cfg = _cfg(steps=12, out=str(tmp_path / "run"), moe_z_coef=0.01)
    result = train(cfg, mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    assert result.losses[-1] < result.losses[0] - 1.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    layer = records[-1]["moe"]["blocks.1.mlp"]
    assert sum(layer["expert_tokens"]) == 8 * 32 * 2 and layer["dropped_fraction"] == 0
    assert layer["balance"] == max(layer["expert_tokens"]) / (sum(layer["expert_tokens"]) / 8)
    assert layer["aux_loss"] >= 1.0 - 1e-6 and layer["z_loss"] > 0  # sum f_i P_i is 1 at best
    tags = scalars(records[-1])
    assert tags["moe/blocks.1.mlp/balance"] == layer["balance"]
    assert [tags[f"moe/blocks.1.mlp/tokens/expert{e}"] for e in range(8)] == layer["expert_tokens"]
    text = report(tmp_path / "run")
    assert "expert load" in text and (tmp_path / "run" / "report.png").exists()


def _train_with_metrics(cfg: Config) -> dict:
    """Runs on every rank: the last step's expert metrics over the global batch."""
    torch.set_num_threads(1)
    return moe_metrics(train(cfg).run)


@pytest.mark.parametrize("model", ["moe-tiny", "deepseek-v3-tiny"])
def test_at_pp2_the_expert_metrics_cover_every_stages_layers(model: str) -> None:
    """Rank 0 writes the record but holds only the first stage (deepseek-v3-tiny's: its dense layer alone):
    the metrics are gathered from every stage, and are the one-process run's."""
    cfg = _cfg(nproc=2, pp=2, microbatches=2, moe_z_coef=0.01, model=model, precision="fp64")
    metrics = run_ranks(_train_with_metrics, 2, cfg, timeout=240)[0]
    single = train(cfg.replace(nproc=1, pp=1), mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
    expected = moe_metrics(single.run)
    assert list(metrics) == list(expected) == [f"blocks.{i}.mlp" for i in range(model == "deepseek-v3-tiny", 2)]
    for name, layer in expected.items():
        assert metrics[name]["expert_tokens"] == layer["expert_tokens"]
        assert all(abs(metrics[name][k] - layer[k]) <= 1e-9 for k in ("dropped_fraction", "aux_loss", "z_loss",
                                                                        "balance")), (name, metrics[name], layer)


REFUSALS = {
    "top-k above experts": (dict(moe_top_k=9), "--moe-top-k 9 exceeds the 8 experts per layer of moe-tiny; "
                                               "choose --moe-top-k in 1..8"),
    "fewer experts than top-k": (dict(moe_experts=1), "--moe-top-k 2 exceeds the 1 experts"),
    "capacity below 1, dropless": (dict(moe_capacity=0.5), "--moe-capacity 0.5 limits what each expert takes (below "
                                                           "1 it drops tokens even under perfect balance), but "
                                                           "routing is dropless; pass --no-moe-dropless"),
    "top-k beyond the expert groups": (dict(model="deepseek-v3-tiny", moe_top_k=6),
                                       "--moe-top-k 6 on deepseek-v3-tiny: top_k=6 experts per token, but its "
                                       "groups_per_token=2 groups of 2 experts hold only 4; lower top_k or raise "
                                       "groups_per_token"),
    "dropping without capacity": (dict(moe_dropless=False), "give the capacity factor with --moe-capacity"),
    "moe flag on a dense model": (dict(model="tiny", moe_experts=4), "--moe-experts configures mixture-of-experts "
                                                                      "layers, which tiny does not have"),
    "no layer left for experts": (dict(moe_dense_layers=2), "--moe-dense-layers 2 leaves no mixture-of-experts layer "
                                                            "among the 2 layers of moe-tiny; choose --moe-dense-layers "
                                                            "below 2, or a dense model"),
    "dense layers of a dense model": (dict(model="llama-tiny", moe_dense_layers=1),
                                      "--moe-dense-layers configures mixture-of-experts layers, which llama-tiny does "
                                      "not have"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_bad_moe_settings_are_one_line(case: str) -> None:
    settings, message = REFUSALS[case]
    with pytest.raises(ConfigError) as e:
        validate(_cfg(**settings))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_capacity_with_dropping_is_accepted() -> None:
    validate(_cfg(moe_dropless=False, moe_capacity=0.5, steps=1))


def _moe(**kw) -> Config:
    base = {"model": "moe-tiny", "nproc": 2, "dp": 2, "ep": 2, "steps": 4, "global_batch": 8, "progress": False,
            "warmup_steps": 1}
    return Config.from_settings(**{**base, **kw})


EP_REFUSALS = {
    "dense model": (dict(model="tiny"), "--ep 2 splits the experts of a mixture-of-experts model, and tiny is dense"),
    "experts": (dict(nproc=3, dp=3, ep=3, global_batch=12), "--ep 3 does not divide the 8 experts per layer of moe-tiny; choose ep "
                                           "in {1, 2, 4, 8}"),
    "dp x cp": (dict(nproc=4, dp=2, tp=2, ep=4), "--ep 4 does not divide dp*cp = 2"),
}


@pytest.mark.parametrize("case", EP_REFUSALS)
def test_bad_ep_settings_are_one_line_before_any_rank_starts(case):
    settings, message = EP_REFUSALS[case]
    with pytest.raises(ConfigError) as e:
        validate(_moe(**settings))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sequence_parallel_moe_layouts_validate():
    validate(_moe(nproc=4, tp=2, sequence_parallel=True))


def _mixtral_config(directory: Path, **layout) -> Config:
    return Config.from_settings(model="llama-moe-tiny", init_hf=str(directory), precision="fp64", progress=False, **layout)


def _mixtral_logits_rank(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(1)
    cfg = _mixtral_config(directory, nproc=2, dp=2, ep=2)
    run = build(cfg, setup_process(cfg))
    load_hf_weights(run, directory)
    with torch.no_grad():
        return run.model(tokens)


def test_a_hugging_face_mixtral_gives_the_same_logits_at_ep2_as_on_one_process(tmp_path):
    """A MixtralForCausalLM (saved by transformers, experts one by one) loaded at ep2, each rank holding two
    of its four experts: the logits of every rank are those of the same checkpoint on one process, which
    the Mixtral import test holds to transformers' own logits."""
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(hf_cfg).double().save_pretrained(tmp_path)
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(1))
    run = build(_mixtral_config(tmp_path), Mesh.build(1, 1, 1, torch.device("cpu")))
    load_hf_weights(run, tmp_path)
    with torch.no_grad():
        reference = run.model(tokens)
    for logits in run_ranks(_mixtral_logits_rank, 2, tmp_path, tokens, timeout=120):
        assert (logits - reference).abs().max() < 1e-12
