"""DeepSeek-V3's latent attention under context parallelism: value heads (16 wide) narrower than the query/key heads
(16 nope + 8 rotary), the rotary key shared by every head; ``deepseek-v3-tiny`` trained at cp2, ring and a2a
(its 4 heads split over the 2 cp ranks), matches one process in float64."""

import pytest
import torch

import trainmesh as tm
from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import preset, spec_of

from helpers import EQUIVALENCE_TABLE, assert_same_training

MODEL = "deepseek-v3-tiny"


def _train(cp: int, cp_impl: str, tp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps of ``deepseek-v3-tiny`` on 32-token sequences at ``cp`` x ``tp`` ranks (one process at 1): the
    losses and final parameters."""
    torch.set_num_threads(1)
    mesh = tm.init_mesh(cp=cp, tp=tp) if cp > 1 else Mesh.build(1, 1, 1, torch.device("cpu"))
    model = spec_of(MODEL).builder(preset(MODEL), 0).double()
    model = tm.parallelize(model, mesh, precision="fp64", cp_impl=cp_impl)
    opt = tm.optimizer(model, lr=3e-3)
    tokens = torch.randint(0, 256, (2, 2, 33), generator=torch.Generator().manual_seed(1))
    losses = [tm.train_step(model, opt, (t[:, :-1], t[:, 1:])) for t in tokens]
    return losses, model.state_dict()


def _both(cp: int) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    return [_train(cp, impl) for impl in ("ring", "a2a")]


def test_deepseek_v3_at_cp2_ring_and_a2a_matches_one_process():
    cfg = preset(MODEL)
    assert cfg.v_head_dim != cfg.qk_nope_head_dim + cfg.qk_rope_head_dim  # value heads of their own width
    reference = _train(1, "ring")
    for impl, parallel in zip(("ring", "a2a"), run_ranks(_both, 2, 2, timeout=180)[0]):
        EQUIVALENCE_TABLE.append((f"cp2 {impl} api {MODEL}", *assert_same_training(reference, parallel)))


@pytest.mark.slow
def test_deepseek_v3_at_tp2_cp2_a2a_matches_one_process():
    """Heads split twice: over tp (``kv_b``, ``q_b``), then over cp by the all-to-all, one head per rank."""
    parallel = run_ranks(_train, 4, 2, "a2a", 2, timeout=240)[0]
    EQUIVALENCE_TABLE.append((f"tp2 cp2 a2a api {MODEL}", *assert_same_training(_train(1, "ring"), parallel)))
