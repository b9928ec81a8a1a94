"""FP8 (torchao's float8 linears, on CPU) under tensor and sequence parallelism: each tp rank casts its part of a
split tensor with the scale one process computes for the whole tensor, and fp8 at tp2 with SP trains as the
one-process fp8 run does, within spreads measured in the same test."""

import pytest
import torch

import trainmesh as tm
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import preset, spec_of
from trainmesh.training.float8 import tp_scales

pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
STEPS = 6


def scales_at_tp2() -> tuple[list[bool], list[bool]]:
    """On each tp rank, float64 tensors split as tp splits them (a weight by rows and by columns, an activation
    along the sequence): whether the tp-wide scales equal the whole tensors' scales, and whether the rank's
    own part would have given another scale (the reduction mattered)."""
    torch.manual_seed(0)
    weight, activation = torch.randn(64, 32, dtype=torch.float64), torch.randn(4, 16, 64, dtype=torch.float64)
    mesh = tm.init_mesh(tp=2, device="cpu")
    rank = mesh.rank("tp")
    wholes, dtypes = (weight, weight, activation), (E4M3, E4M3, E5M2)
    parts = [weight.chunk(2, 0)[rank], weight.chunk(2, 1)[rank], activation.chunk(2, 1)[rank]]
    got = tp_scales(parts, dtypes, Float8LinearConfig(), Comm(mesh))
    want = [tensor_to_scale(t, d) for t, d in zip(wholes, dtypes)]
    own = [tensor_to_scale(t, d) for t, d in zip(parts, dtypes)]
    return [torch.equal(g, w) for g, w in zip(got, want)], [not torch.equal(o, w) for o, w in zip(own, want)]


def test_each_tp_rank_casts_with_the_scales_of_the_whole_tensors():
    results = run_ranks(scales_at_tp2, 2, timeout=120)
    assert all(all(same) for same, _ in results), results
    assert all(any(ranks) for ranks in zip(*(differs for _, differs in results))), results


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, 256, (STEPS, 8, 33), generator=torch.Generator().manual_seed(1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def losses(layouts: list[dict]) -> list[list[float]]:
    """Per-step losses of the tiny GPT trained through the public API in each layout (lr 0: every step is the
    same parameters on another batch, free of training's amplification of small differences)."""
    torch.set_num_threads(1)
    runs = []
    for layout in layouts:
        tp = layout.get("tp", 1)
        model = spec_of("tiny").builder(preset("tiny"), 0)
        pm = tm.parallelize(model, tm.init_mesh(tp=tp, device="cpu"), precision=layout["precision"],
                            sequence_parallel=tp > 1)
        opt = tm.optimizer(pm, lr=layout["lr"])
        runs.append([tm.train_step(pm, opt, batch) for batch in batches()])
    return runs


def _distance(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


@pytest.mark.slow
def test_fp8_at_tp2_with_sp_tracks_one_process_fp8_within_the_spreads_measured_beside_it():
    """With one process's scales, tp changes only bf16 roundings (partial sums reduced in bf16), which float8's
    rounding passes on at about their own size. At fixed parameters (lr 0) fp8's tp distance is held to half
    float8's own distance from bf16, which casting a split tensor with its part's scale reaches (it re-rounds
    every element); in training (lr 1e-3) to 16 times bf16's tp distance, e4m3's unit roundoff over bf16's."""
    layouts = [dict(precision=p, lr=lr) for lr in (0.0, 1e-3) for p in ("fp8", "bf16")]
    fp8_fixed, bf16_fixed, fp8_one, bf16_one = run_ranks(losses, 1, layouts, timeout=300)[0]
    at_tp2 = [dict(layout, tp=2) for layout in (layouts[0], *layouts[2:])]
    fp8_tp_fixed, fp8_tp, bf16_tp = run_ranks(losses, 2, at_tp2, timeout=300)[0]
    fixed_gap, own = _distance(fp8_tp_fixed, fp8_fixed), _distance(fp8_fixed, bf16_fixed)
    assert fixed_gap < own / 2, (fixed_gap, own)
    floor, gap = _distance(bf16_tp, bf16_one), _distance(fp8_tp, fp8_one)
    assert 0 < floor and gap < 16 * floor, (floor, gap, fp8_tp, fp8_one)
    assert fp8_tp != bf16_tp  # float8 took effect under tp
