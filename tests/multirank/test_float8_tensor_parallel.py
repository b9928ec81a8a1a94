"""FP8 (torchao's float8 linears, on CPU) under tensor and sequence parallelism: each tp rank casts its part of a
split tensor with the scale one process computes for the whole tensor, and fp8 at tp2 with SP trains as the
one-process fp8 run does, within tp's own bf16 noise seen through e4m3's coarser rounding."""

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
STEPS = 4


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
    """Per-step losses of the tiny GPT trained through the public API in each layout."""
    torch.set_num_threads(1)
    runs = []
    for layout in layouts:
        tp = layout.get("tp", 1)
        model = spec_of("tiny").builder(preset("tiny"), 0)
        pm = tm.parallelize(model, tm.init_mesh(tp=tp, device="cpu"), precision=layout["precision"],
                            sequence_parallel=tp > 1)
        opt = tm.optimizer(pm, lr=1e-3)
        runs.append([tm.train_step(pm, opt, batch) for batch in batches()])
    return runs


def _distance(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


@pytest.mark.slow
def test_fp8_at_tp2_with_sp_tracks_one_process_fp8_within_tps_bf16_noise_times_sixteen():
    """tp changes only bf16 roundings (partial sums reduced in bf16); with the same scales float8 may round those
    perturbed inputs a step of e4m3 apart, and e4m3's unit roundoff is 16 times bf16's, so fp8's tp distance is
    held to 16 times bf16's, both measured here over the same steps."""
    fp8_one, bf16_one = run_ranks(losses, 1, [dict(precision="fp8"), dict(precision="bf16")], timeout=300)[0]
    fp8_tp, bf16_tp = run_ranks(losses, 2, [dict(tp=2, precision="fp8"), dict(tp=2, precision="bf16")],
                                timeout=300)[0]
    floor, gap = _distance(bf16_tp, bf16_one), _distance(fp8_tp, fp8_one)
    assert 0 < floor and gap < 16 * floor, (floor, gap, fp8_tp, fp8_one)
    assert fp8_tp != bf16_tp  # float8 took effect under tp
