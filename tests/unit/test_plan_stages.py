"""Uneven pipeline stages in the planner: the splits it searches, the runtime's own split it models when
none is given, and the bubble of a real split against the schedule simulator."""

from __future__ import annotations

import shlex

import pytest

from trainmesh.app import cli
from trainmesh.app.config import config_from_args
from trainmesh.app.planning import layout_of, preset_source, train_command
from trainmesh.models import preset, spec_of
from trainmesh.pipeline.partition import partition_model
from trainmesh.pipeline.schedules import schedule_1f1b, schedule_gpipe
from trainmesh.pipeline.simulate import Costs, simulate
from trainmesh.plan import Layout, Workload, make_cluster, memory_per_rank, model_shape, search
from trainmesh.plan.stages import fastest_split, parameter_split
from trainmesh.plan.timing import layer_seconds, pipeline_bubble
from trainmesh.plan.workload import stage_split


def test_llama3_405b_on_16_stages_gets_the_papers_split_with_one_block_less_at_each_end() -> None:
    """Llama 3 paper, 3.3.2: 126 layers on pp=16, one layer fewer on the first and the last stage."""
    work, cluster = Workload(model_shape("llama3-405b"), 2048, 8192, "bf16"), make_cluster("h100-80gb", 2048)
    assert fastest_split(*layer_seconds(work, Layout(tp=8), cluster), 16) == (7,) + (8,) * 14 + (7,)


def test_the_head_takes_blocks_off_the_last_stage_only_when_it_costs_more_than_a_block_beside_them() -> None:
    assert fastest_split((1.0,) * 8, 0.5, 4) == (2, 2, 2, 2)  # 2.5 on the last beats 3 anywhere
    assert fastest_split((1.0,) * 8, 1.5, 4) == (1, 3, 3, 1)  # the last at 2.5; the slack off the first
    assert fastest_split((1.0,) * 10, 0.0, 4) == (1, 3, 3, 3)


def test_layers_that_do_not_divide_by_the_pipeline_are_planned_and_printed_as_stage_layers() -> None:
    """deepseek-v3 has 61 layers: no pp > 1 divides them, and the search still pipelines it."""
    work, cluster = Workload(model_shape("llama-tiny"), 8, 64, "fp32"), make_cluster("cpu", 3)
    piped = [e for e in search(work, cluster) if e.layout.pp == 3]
    assert piped and all(sum(e.layout.stage_layers) == work.model.n_layers for e in piped)
    work = Workload(model_shape("tiny-deep"), 6, 32, "fp32")
    found = next(e for e in search(work, make_cluster("cpu", 3)) if e.layout.pp == 3)
    line = train_command(work, found.layout, make_cluster("cpu", 3), preset_source(work, "tiny-deep"))[-1]
    words = shlex.split(line)
    assert words[words.index("--stage-layers") + 1] == ",".join(map(str, found.layout.stage_layers))
    cfg = config_from_args(cli._parser().parse_args(words[1:]))
    assert layout_of(cfg) == found.layout and cfg.layout.stage_layers == found.layout.stage_layers


@pytest.mark.parametrize("name,chunks", [("tiny-deep", 3), ("tiny-deep", 6), ("llama-tiny", 2)])
def test_without_stage_layers_the_planner_models_the_runtimes_own_split(name: str, chunks: int) -> None:
    spec = spec_of(name)
    model = spec.builder(preset(name), 0)
    built = tuple(len(r) for r in partition_model(model, chunks))
    assert parameter_split(spec.shape(preset(name)), chunks) == built
    layout = Layout(pp=chunks, microbatches=chunks) if chunks <= 4 else Layout(pp=3, virtual_stages=2, microbatches=3,
                                                                                schedule="interleaved")
    assert stage_split(Workload(spec.shape(preset(name)), 6, 32, "fp32"), layout) == built


def test_a_split_holds_memory_where_its_blocks_are() -> None:
    work = Workload(model_shape("tiny-deep"), 4, 32, "fp32")
    light, heavy = (Layout(pp=2, microbatches=2, stage_layers=s) for s in ((2, 6), (6, 2)))
    assert memory_per_rank(work, light, 0).params < memory_per_rank(work, heavy, 0).params
    with pytest.raises(ValueError, match="must give 2 counts .* summing to the 8 layers"):
        memory_per_rank(work, Layout(pp=2, microbatches=2, stage_layers=(3, 3)))


@pytest.mark.parametrize("forward", [(1.0, 1.0, 1.0, 1.0), (0.5, 1.0, 1.0, 1.0), (1.0, 1.5, 1.5, 1.2),
                                     (1.0, 1.0, 1.0, 0.5)])
@pytest.mark.parametrize("schedule,build", [("1f1b", schedule_1f1b), ("gpipe", schedule_gpipe)])
@pytest.mark.parametrize("m", [4, 16])
def test_the_bubble_of_uneven_stages_matches_the_simulator(forward: tuple[float, ...], schedule: str, build,
                                                          m: int) -> None:
    """Exact for equal stages and lighter first stages; an upper bound within 6 % of the step otherwise."""
    times = [3 * f for f in forward]
    predicted = m * max(times) + pipeline_bubble(times, Layout(pp=4, microbatches=m, schedule=schedule))
    simulated = simulate(build(4, m), Costs(forward=forward, backward=tuple(2 * f for f in forward))).makespan
    assert simulated <= predicted + 1e-9 and predicted <= 1.06 * simulated
    if forward[-1] >= max(forward[:-1]) or forward == (1.0,) * 4:
        assert predicted == pytest.approx(simulated, rel=1e-12)
