"""The planner's hybrid sharding (HSDP): data-parallel bytes inside and across nodes against the formulas
``make bench-multinode`` checks its counted bytes with, HSDP's memory as ZeRO over one replica group, and
``trainmesh plan`` showing ZeRO-3 against HSDP, choosing by the bytes on the slow link, and printing
``--dp-replicate``. Pure: no rank is started."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

import pytest

from trainmesh.app import cli
from trainmesh.app.config import config_from_args
from trainmesh.app.planning import add_plan_arguments, plan_from_args, train_command, preset_source
from trainmesh.layout import LayoutError
from trainmesh.plan import (Layout, Workload, check_layout, choose, estimate, format_table, make_cluster, model_shape,
                            model_state_bytes, to_json)
from trainmesh.plan.dp_traffic import dp_traffic
from trainmesh.plan.memory import stage_units
from trainmesh.plan.ranking import hsdp_replicas
from trainmesh_bench.multinode import crossing_formula, planned, report_row

SMALL = model_shape("small")  # every ZeRO unit divides by the ranks below: no padding


def _psi(shape=SMALL) -> int:
    return sum(u.numel * k for u, k in stage_units(shape, 1, (shape.n_layers,), 1, 0))


def _crossing(world: int, per_node: int, replicas: int, gpu: str) -> float:
    """Bytes every rank of a ZeRO-3 step sends to other nodes, summed over ranks (fp32, one micro-batch)."""
    cluster = make_cluster(gpu, world, per_node)
    layout = Layout(dp=world, zero=3, dp_replicate=replicas)
    return world * dp_traffic(Workload(SMALL, world, SMALL.seq_len, "fp32"), layout, cluster, 0).inter


@pytest.mark.parametrize("world,per_node", [(4, 2), (8, 4), (8, 2)])
def test_point_to_point_crossing_bytes_are_the_bench_formulas(world: int, per_node: int) -> None:
    """On Gloo between hosts (the ``cpu`` cluster) ZeRO-3 over N ranks, M a node, sends 3(N-M)Psi b across
    nodes per step; HSDP with one group per node 2(R-1)Psi b: exactly what the bench counts on the link."""
    psi, replicas = _psi(), world // per_node
    assert _crossing(world, per_node, 1, "cpu") == crossing_formula(psi, 4, 1, world, per_node)
    assert _crossing(world, per_node, replicas, "cpu") == pytest.approx(
        crossing_formula(psi, 4, replicas, world, per_node), rel=1e-12)
    assert crossing_formula(psi, 4, replicas, world, per_node) == 2 * (replicas - 1) * psi * 4


@pytest.mark.parametrize("world,per_node", [(16, 8), (32, 8)])
def test_ring_crossing_bytes_are_one_hop_in_each_node(world: int, per_node: int) -> None:
    """Round NCCL's ring each of the k nodes sends one hop of (N-1)/N of every buffer across: 3k(N-1)/N Psi b
    for ZeRO-3; HSDP's shard all-reduce is a ring too, 2(R-1)Psi b as on Gloo."""
    psi, nodes = _psi(), world // per_node
    assert _crossing(world, per_node, 1, "h100-80gb") == pytest.approx(3 * nodes * (world - 1) / world * psi * 4)
    assert _crossing(world, per_node, nodes, "h100-80gb") == pytest.approx(2 * (nodes - 1) * psi * 4)


def _two_node_crossing(world: int, per_node: int, ring: bool) -> float:
    """Bytes per step all ranks of ZeRO-3 in groups of two nodes send to other nodes: each group's gathers
    and reduce-scatter cross inside it (a ring on one hop in ``per_node``, point to point to the group's
    ``per_node`` ranks on the other node) and the shards' ring all-reduce across the R = world / 2M groups."""
    group, replicas, psi_b = 2 * per_node, world // (2 * per_node), _psi() * 4
    inside = 3 * (group - 1) / per_node if ring else 3 * per_node
    return replicas * inside * psi_b + 2 * (replicas - 1) * psi_b


@pytest.mark.parametrize("world,per_node,gpu", [(8, 2, "cpu"), (16, 2, "cpu"), (32, 8, "h100-80gb"),
                                                (64, 8, "h100-80gb")])
def test_a_group_of_two_nodes_sends_its_own_gathers_across_its_nodes(world: int, per_node: int, gpu: str) -> None:
    replicas = world // (2 * per_node)
    assert _crossing(world, per_node, replicas, gpu) == pytest.approx(
        _two_node_crossing(world, per_node, gpu != "cpu"), rel=1e-12)


def test_the_search_tries_zero_groups_of_one_or_several_whole_nodes() -> None:
    """64 ranks, 8 a node, tp4: a dp group has 2 ranks a node on 8 nodes, so groups of 1, 2 or 4 nodes."""
    cluster = make_cluster("h100-80gb", 64)
    assert hsdp_replicas(16, 1, 4, cluster) == [8, 4, 2]
    assert hsdp_replicas(8, 1, 1, cluster) == []  # the whole group is one node
    assert hsdp_replicas(8, 1, 8, cluster) == []  # one rank of it a node


def test_a_model_too_big_for_one_node_groups_replicates_groups_of_two_nodes() -> None:
    """llama3-70b over tp4 on 8 H200 nodes: ZeRO-3 groups of one node (2 ranks) hold 1/2 of a tp rank's
    state and do not fit; groups of 2 nodes (4 ranks) fit and move fewer bytes across nodes than ZeRO-3
    over all 16 dp ranks, so HSDP with R = dp / (2 x 2) = 4 is chosen and its command says so."""
    work, cluster = Workload(model_shape("llama3-70b"), 64, 4096, "bf16"), make_cluster("h200-141gb", 64)
    flat = Layout(dp=16, tp=4, zero=3, microbatches=4, sequence_parallel=True, recompute="full")
    found = [estimate(work, dataclasses.replace(flat, dp_replicate=r), cluster)
             for r in (1, *hsdp_replicas(flat.dp, flat.cp, flat.tp, cluster))]
    one_node = next(e for e in found if e.layout.shard_ranks == 2)
    assert one_node.memory.total > cluster.usable_bytes
    fitting = sorted((e for e in found if e.memory.total <= cluster.usable_bytes), key=lambda e: e.time.total)
    chosen = choose(fitting)
    assert chosen.layout.dp_replicate == 4 and chosen.layout.shard_ranks == 4
    words = shlex.split(train_command(work, chosen.layout, cluster, preset_source(work, "llama3-70b"))[-1])
    assert config_from_args(cli._parser().parse_args(words[words.index("train"):])).layout.dp_replicate == 4


def test_inside_one_node_nothing_crosses() -> None:
    assert _crossing(8, 8, 1, "h100-80gb") == 0 == _crossing(8, 8, 1, "cpu")


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_memory_is_zero_over_one_replica_group(zero: int) -> None:
    work = Workload(model_shape("gpt2-124m"), 64, 1024, "bf16")
    hybrid = Layout(dp=16, zero=zero, dp_replicate=4, microbatches=2)
    assert model_state_bytes(work, hybrid) == model_state_bytes(work, Layout(dp=4, zero=zero, microbatches=2))
    assert model_state_bytes(work, hybrid) > model_state_bytes(work, dataclasses.replace(hybrid, dp_replicate=1))


def test_the_planners_layouts_keep_the_hybrid_sharding_rule() -> None:
    work = Workload(model_shape("gpt2-124m"), 64, 1024, "bf16")
    with pytest.raises(LayoutError, match="dp_replicate"):
        check_layout(work, Layout(dp=8, zero=0, dp_replicate=2))
    with pytest.raises(LayoutError, match="does not divide"):
        check_layout(work, Layout(dp=8, zero=3, dp_replicate=3))


def test_a_chosen_hsdp_says_the_bytes_it_keeps_off_the_slow_link_and_its_command_replicates() -> None:
    """On 12.5 GB/s of inter-node link per GPU (100 Gb/s), where ZeRO-3's gathers across both nodes outlast
    the compute they run behind (at 50 GB/s they hide, and the flat layout wins)."""
    work = Workload(model_shape("llama3-8b"), 32, 8192, "bf16")
    cluster = make_cluster("h100-80gb", 16, inter_gbps=12.5)
    flat = Layout(dp=8, tp=2, zero=3, microbatches=2, sequence_parallel=True)
    hybrid = dataclasses.replace(flat, dp_replicate=2)
    found = sorted((estimate(work, lay, cluster) for lay in (flat, hybrid)), key=lambda e: e.time.total)
    chosen = choose(found)
    command = train_command(work, chosen.layout, cluster, preset_source(work, "llama3-8b"))
    text = format_table(work, cluster, found, chosen, command).splitlines()
    assert chosen.layout == hybrid
    why = next(line for line in text if line.startswith("why: "))
    assert "less data-parallel traffic" in why and "over the inter-node link against the runner-up's" in why
    words = shlex.split(text[-1])
    cfg = config_from_args(cli._parser().parse_args(words[words.index("train"):]))
    assert (cfg.layout.dp, cfg.layout.tp, cfg.layout.zero, cfg.layout.dp_replicate) == (8, 2, 3, 2)
    rows = json.loads(to_json(work, cluster, found, chosen))["layouts"]
    assert rows[0]["dp_bytes_per_rank"]["inter"] < rows[1]["dp_bytes_per_rank"]["inter"]


def test_plan_llama3_70b_on_256_h100s_shows_zero3_and_hsdp_and_its_choice() -> None:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    lines = plan_from_args(parser.parse_args("--model llama3-70b --gpus 256 --gpu h100-80gb --top 3".split()))
    lines = lines.splitlines()
    head = lines[1].split()
    rows = [dict(zip(head, line.replace("*", "").split())) for line in lines[2:] if line[:1] in " *"]
    zero3 = [r for r in rows if r["zero"] == "3"]
    assert {r["R"] == "1" for r in zero3} == {True, False}
    versus = next(line for line in lines if line.startswith("ZeRO-3 vs HSDP"))
    assert "per rank across nodes" in versus and "s/step faster" in versus and "the choice (*) shards with" in versus


def test_the_bench_prints_the_planners_prediction_beside_the_measured_figures() -> None:
    predicted, seconds = planned(2, "small", 8, 200.0)
    assert predicted == crossing_formula(_psi(), 4, 2) and seconds > 0
    assert planned(1, "small", 8, 200.0)[0] == crossing_formula(_psi(), 4, 1)
    row = report_row("hsdp2x2", {"link_bytes_per_step": 26.67e6, "formula": predicted, "step_s": 1.2},
                     predicted, seconds).split()
    assert row[0] == "hsdp2x2" and float(row[4]) == round(predicted / 1e6, 2) and float(row[6]) == round(seconds, 2)
