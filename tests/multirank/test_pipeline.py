"""Pipeline runtime: every schedule trains to the single-process losses and parameters (alone and with data
parallel), stages are cut as asked, gradients sync once per step, and timelines are drawn from real runs."""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
import subprocess
import sys

import pytest
import torch

from trainmesh.distributed.mesh import Mesh
from trainmesh.models.gpt import GPT, PRESETS
from trainmesh.pipeline.partition import balanced_partition, explicit_partition, partition_model, split_model
from trainmesh.pipeline.runtime import PipelineRuntime, forward_only, hoist_receives, last_weight_gradients
from trainmesh.pipeline.schedules import SCHEDULES, SEND_KINDS, ActionKind, build_schedule
from trainmesh.pipeline.simulate import simulate
from trainmesh.distributed.testing import run_ranks

from helpers import Case, build, check_equivalent, config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cfg(pp: int, schedule: str, dp: int = 1, model: str = "tiny", **kw) -> Case:
    return config(pp=pp, dp=dp, schedule=schedule, model=model, steps=4, microbatches=4, **kw)


def _interleaved(pp: int, dp: int = 1) -> Case:
    return _cfg(pp, "interleaved", dp, model="tiny-deep", virtual_stages=2)


# --- equivalence with a single process ---------------------------------------------------------------


def test_every_schedule_at_pp2_matches_single_process():
    check_equivalent([_cfg(2, "gpipe"), _cfg(2, "1f1b"), _cfg(2, "zb"), _interleaved(2),
                      _cfg(2, "zb", model="tiny-deep", stage_layers="3,5")], world_size=2)


@pytest.mark.slow  # pp2 covers every schedule and dp2 x pp2 zb runs with ZeRO-3 in the default set
def test_pp4_and_dp2_pp2_match_single_process():
    check_equivalent([_cfg(4, "1f1b", model="tiny-deep"), _cfg(2, "zb", dp=2, bucket_mb=0.05)], world_size=4)


@pytest.mark.slow
def test_remaining_schedules_at_pp4_and_dp2_pp2_match_single_process():
    check_equivalent([_cfg(4, "gpipe", model="tiny-deep"), _cfg(4, "zb", model="tiny-deep"), _interleaved(4),
                      _cfg(2, "gpipe", dp=2), _cfg(2, "1f1b", dp=2, bucket_mb=0.05), _interleaved(2, dp=2)],
                     world_size=4, timeout=400)


@pytest.mark.slow
def test_pipeline_composes_with_zero_and_tensor_parallel():
    check_equivalent([_cfg(2, "1f1b", dp=2, zero=1), _cfg(2, "zb", dp=2, zero=2), _cfg(2, "1f1b", dp=2, zero=3),
                      _cfg(2, "zb", tp=2)], world_size=4, timeout=400)


def test_zero3_with_zero_bubble_matches_single_process():
    """ZeRO-3 gathers and frees each unit for the zero-bubble input- and weight-gradient passes apart."""
    check_equivalent([_cfg(2, "zb", dp=2, zero=3)], world_size=4)


@pytest.mark.slow
def test_every_schedule_with_every_zero_stage_matches_single_process():
    cfgs = [_cfg(2, name, dp=2, zero=z) for name in ("gpipe", "1f1b", "zb") for z in (1, 2, 3)]
    check_equivalent(cfgs + [dataclasses.replace(_interleaved(2, dp=2), zero=z) for z in (1, 2, 3)],
                     world_size=4, timeout=500)


def _zero_step_events(cfgs: list[Case]) -> list[dict]:
    """Per config, after one step's forwards and backwards: how often each ZeRO group was gathered per op
    and reduce-scattered, the most ZeRO-3 units gathered at once, and what is still gathered or held."""
    torch.set_num_threads(1)
    facts = []
    for cfg in cfgs:
        run = build(cfg)
        run.forward_backward(0)
        engine, counts, gathered, most = run.engine, collections.Counter(), set(), 0
        for kind, name, *op in engine.events:
            if kind in ("gather", "reduce_scatter"):
                counts[(kind, name, *op)] += 1
            if kind == "gather":
                gathered.add(name)
            elif kind == "free":
                gathered.discard(name)
            most = max(most, len(gathered))
        units = getattr(engine, "units", [])
        facts.append({"groups": [g.name for g in engine.groups], "counts": counts, "most_gathered": most,
                      "gathered": [u.name for u in units if u.gathered],
                      "grads_held": [g.name for g in engine.groups if g.grad_flat is not None]})
    return facts


def test_zero_under_zero_bubble_reduces_once_per_microbatch_and_frees_between_passes():
    """The weight pass makes one autograd call per module, yet each group is reduce-scattered once per
    micro-batch; ZeRO-3 gathers each unit once per pass (forward, input and weight gradient) and holds
    two at a time (the one computing and the one prefetched), as under 1F1B's single backward."""
    m = 4
    cfgs = [_cfg(2, "zb", model="tiny-deep", zero=2, bucket_mb=0.1), _cfg(2, "zb", model="tiny-deep", zero=3),
            _cfg(2, "1f1b", model="tiny-deep", zero=3)]
    for facts in run_ranks(_zero_step_events, 2, cfgs, timeout=120):
        zero2, zero3, zero3_1f1b = facts
        assert len(zero2["groups"]) > 1
        for f in (zero2, zero3):
            assert all(f["counts"][("reduce_scatter", g)] == m for g in f["groups"]), f["counts"]
            assert f["gathered"] == [] and f["grads_held"] == []
        for unit in zero3["groups"]:
            assert zero3["counts"][("gather", unit, "fwd_param_all_gather")] == m
            assert zero3["counts"][("gather", unit, "bwd_param_all_gather")] == 2 * m
        assert zero3["most_gathered"] == zero3_1f1b["most_gathered"] == 2


# --- one step on real ranks: gradient sync, evaluation, measured timeline ----------------------------


def _step_facts(cfgs: list[Case]) -> list[dict]:
    torch.set_num_threads(1)
    facts = []
    for cfg in cfgs:
        run = build(cfg)
        run.pipeline.recording = True
        run.forward_backward(0)
        launched = [i for kind, i in run.engine.events if kind == "launch"]
        ready = sum(kind == "ready" for kind, _ in run.engine.events)
        run.pipeline.recording = False
        timeline = run.pipeline.gather_timeline()
        n_params = sum(1 for p in run.model.parameters() if p.requires_grad)
        facts.append({"launched": launched, "buckets": len(run.engine.buckets), "ready": ready,
                      "params": n_params, "timeline": timeline, "val_loss": run.evaluate()})
    return facts


def test_buckets_fire_once_per_step_evaluation_and_measured_timeline():
    cfgs = [_cfg(2, name, bucket_mb=0.02) for name in ("gpipe", "1f1b", "zb")] + [_interleaved(2)]
    per_rank = run_ranks(_step_facts, 2, cfgs, timeout=180)
    for cfg, facts in zip(cfgs, zip(*per_rank)):
        for f in facts:
            assert f["launched"] == list(range(f["buckets"])), f"{cfg.schedule}: each bucket fires once, in order"
            assert f["ready"] == f["params"], f"{cfg.schedule}: one synced gradient per parameter per step"
        timeline = facts[0]["timeline"]
        compute = [r.action for r in timeline.records if r.action.is_compute]
        expected = [a for acts in build_schedule(cfg.schedule, 2, 4, cfg.virtual_stages) for a in acts
                    if a.is_compute]
        assert sorted(map(str, compute)) == sorted(map(str, expected))
        assert 0 < timeline.bubble_fraction < 1
        sends = {r.action for r in timeline.records if r.action.kind in SEND_KINDS}
        assert set(timeline.sent) == sends, f"{cfg.schedule}: every send's leaving time is recorded"
        assert min(timeline.transfers(0.0).values()) >= 0
        single = dataclasses.replace(cfg, pp=1, virtual_stages=1)
        reference = build(single, Mesh.build(1, 1, 1, torch.device("cpu"))).evaluate()
        assert facts[0]["val_loss"] == pytest.approx(reference, abs=1e-5)


# --- stage partitioning -------------------------------------------------------------------------------


def test_balanced_partition_evens_uniform_layers_and_unloads_heavy_ends():
    assert balanced_partition([10] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert balanced_partition([10] * 8, 4, first_extra=25, last_extra=25) == [
        range(0, 1), range(1, 4), range(4, 7), range(7, 8)]


def test_balanced_partition_is_optimal():
    rng = random.Random(0)
    for _ in range(30):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(2, 9))]
        stages = rng.randint(1, len(sizes))
        ranges = balanced_partition(sizes, stages)
        assert [i for r in ranges for i in r] == list(range(len(sizes))) and all(ranges)
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
                   for cuts in _cut_points(len(sizes), stages - 1))
        assert max(sum(sizes[i] for i in r) for r in ranges) == best


def _cut_points(n: int, k: int, start: int = 1):
    if k == 0:
        yield ()
        return
    for c in range(start, n - k + 1):
        for rest in _cut_points(n, k - 1, c + 1):
            yield (c, *rest)


def test_partition_by_parameter_count_or_explicit():
    model = GPT(PRESETS["tiny-deep"])
    assert partition_model(model, 2) == [range(0, 4), range(4, 8)]
    assert partition_model(model, 2, (3, 5)) == [range(0, 3), range(3, 8)]
    assert explicit_partition((1, 1, 2), 4) == [range(0, 1), range(1, 2), range(2, 4)]
    with pytest.raises(ValueError, match="sum to the model's 4 layers"):
        explicit_partition((1, 2), 4)
    with pytest.raises(ValueError, match="one count per stage"):
        partition_model(model, 4, (4, 4))
    with pytest.raises(ValueError, match="at most 8 stages"):
        balanced_partition([1] * 8, 9)


@pytest.mark.parametrize("n_ranks,n_virtual", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_stages_keep_plain_names_and_compose_to_the_full_model(n_ranks, n_virtual):
    cfg = PRESETS["tiny-deep"]
    full = GPT(cfg, seed=3)
    names = {n for n, _ in full.named_parameters()}
    layers = balanced_partition([1] * cfg.n_layers, n_ranks * n_virtual)
    stages, seen = {}, set()
    for rank in range(n_ranks):
        part, chunks = split_model(GPT(cfg, seed=3), layers, rank, n_ranks, n_virtual)
        mine = {n for n, _ in part.named_parameters()}
        assert mine <= names and not mine & seen
        seen |= mine
        chunk_params = [set(map(id, c.parameters())) for c in chunks.values()]
        assert set().union(*chunk_params) == set(map(id, part.parameters()))
        assert sum(map(len, chunk_params)) == len(set().union(*chunk_params)), "chunks share no parameters"
        stages.update(chunks)
    assert seen == names
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    h = x
    for s in range(n_ranks * n_virtual):
        h = stages[s](h)
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)


# --- action lists as the runtime executes them ---------------------------------------------------------


def _cases():
    for name in SCHEDULES:
        for p in (2, 4):
            for m in (1, 4, 8):
                for v in (1, 2) if name == "interleaved" else (1,):
                    if name != "interleaved" or m % p == 0:
                        yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_hoisted_receives_keep_comm_order_and_stay_deadlock_free(name, p, m, v):
    lists = build_schedule(name, p, m, v)
    hoisted = [hoist_receives(acts) for acts in lists]
    simulate(hoisted, n_microbatches=m, n_virtual=v)  # verifies under rendezvous sends: raises if stuck
    for before, after in zip(lists, hoisted):
        assert sorted(map(str, before)) == sorted(map(str, after))
        assert [a for a in before if a.is_comm] == [a for a in after if a.is_comm]
        assert [a for a in before if a.is_compute] == [a for a in after if a.is_compute]


def test_sync_on_each_stage_last_weight_gradient_and_forward_only_lists():
    zb = build_schedule("zb", 2, 4)[0]
    assert {str(a) for a in last_weight_gradients(zb)} == {"BW3s0"}
    interleaved = build_schedule("interleaved", 2, 4, 2)[1]
    assert {str(a) for a in last_weight_gradients(interleaved)} == {"B3s1", "B3s3"}
    for acts in build_schedule("1f1b", 4, 8):
        kinds = {a.kind for a in forward_only(acts)}
        assert kinds <= {ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F}
        assert sum(a.kind is ActionKind.F for a in forward_only(acts)) == 8


class _LoggedWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> None:
        self.log.append(self.name)


class _LoggingComm:
    """Stands in for Comm on one rank without processes: one handle per operation, logging its wait."""

    def __init__(self, mesh: Mesh, log: list[str]) -> None:
        self.mesh, self.log, self.posted = mesh, log, 0

    def send_recv(self, sends, recvs, axis):
        works = []
        for _ in [*sends, *recvs]:
            works.append(_LoggedWork(self.log, f"wait{self.posted}"))
            self.posted += 1
        return works

    def open_channels(self, *_) -> bool:
        return False


def test_each_receive_is_waited_for_just_before_its_consumer():
    """GPipe's last stage posts all its receives at once; each forward must wait only for its own."""
    log: list[str] = []
    mesh = Mesh({"pp": 2, "dp": 1, "cp": 1, "tp": 1}, {"pp": 1, "dp": 0, "cp": 0, "tp": 0}, torch.device("cpu"))
    cfg = PRESETS["tiny"]
    _, chunks = split_model(GPT(cfg), [range(0, 1), range(1, 2)], rank=1, n_ranks=2)
    chunks[1].register_forward_pre_hook(lambda *_: log.append("F"))
    runtime = PipelineRuntime(chunks, _LoggingComm(mesh, log), "gpipe", 4, 1, cfg.d_model, torch.float32)
    micro = [(torch.zeros(2, cfg.seq_len, dtype=torch.long),) * 2] * 4
    with torch.no_grad():
        runtime.evaluate(micro, lambda logits, y: logits.float().mean())
    assert log == ["wait0", "F", "wait1", "F", "wait2", "F", "wait3", "F"]


def test_a_stage_output_of_the_wrong_shape_is_not_sent():
    mesh = Mesh({"pp": 2, "dp": 1, "cp": 1, "tp": 1}, {"pp": 0, "dp": 0, "cp": 0, "tp": 0}, torch.device("cpu"))
    cfg = PRESETS["tiny"]
    _, chunks = split_model(GPT(cfg), [range(0, 1), range(1, 2)], rank=0, n_ranks=2)
    runtime = PipelineRuntime(chunks, _LoggingComm(mesh, []), "gpipe", 2, 1, cfg.d_model, torch.float32,
                              seq_shards=2)
    micro = [(torch.zeros(2, cfg.seq_len, dtype=torch.long),) * 2] * 2
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"produced shape \(2, 32, 64\), but the pipeline "
                                                            r"passes \(2, 16, 64\)"):
        runtime.evaluate(micro, lambda logits, y: logits.float().mean())


# --- command line -------------------------------------------------------------------------------------


def _trainmesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmesh", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_schedule_command_prints_and_draws(tmp_path):
    png = tmp_path / "out.png"
    result = _trainmesh("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--png", str(png))
    assert result.returncode == 0, result.stderr
    assert "bubble fraction 0.2727" in result.stdout
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    bad = _trainmesh("schedule", "--pp", "4", "--microbatches", "6", "--schedule", "interleaved", "--virtual-stages", "2")
    assert bad.returncode == 2 and "multiple of n_stages" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # the measured timeline stays in the default set: test_buckets_fire_once_per_step_...
def test_train_draws_the_measured_timeline(tmp_path):
    png, out = tmp_path / "timeline.png", tmp_path / "run"
    result = _trainmesh("train", "--nproc", "2", "--pp", "2", "--schedule", "zb", "--steps", "2",
                        "--global-batch", "8", "--microbatches", "4", "--timeline", str(png), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"timeline of the last step drawn to {png}" in result.stdout
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    simulated = re.search(r"simulated from its measured costs (\d\.\d{4})", result.stdout).group(1)
    assert re.search(r"\(0\.\d{4} with each action's and message's own measured time;", result.stdout)
    again = _trainmesh("schedule", "--pp", "2", "--microbatches", "4", "--schedule", "zb",
                       "--costs", str(png.with_suffix(".costs.json")))
    assert again.returncode == 0, again.stderr
    assert f"bubble fraction {simulated}" in again.stdout  # trainmesh schedule predicts the drawn step alike
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["comm_bytes"]["pp"] > 0
