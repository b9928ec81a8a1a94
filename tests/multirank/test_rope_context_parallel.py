"""RoPE scaling under context parallelism: each cp rank computes the scaled rotary angles of its own tokens'
global positions, so a llama3-scaled ``llama-tiny`` trained at cp2 (ring) matches one process in float64."""

import dataclasses

import torch

import trainmesh as tm
from trainmesh.distributed.mesh import Mesh
from trainmesh.models import preset
from trainmesh.models.llama import Llama
from trainmesh.models.rope import RopeScaling
from trainmesh.distributed.testing import run_ranks

from helpers import EQUIVALENCE_TABLE, assert_same_training

LLAMA3 = RopeScaling("llama3", factor=8.0, original_max_position_embeddings=16)


def _train(scaling: RopeScaling | None, cp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps of ``llama-tiny`` with ``scaling`` on 64-token sequences at ``cp`` ranks (one process at 1):
    the losses and final parameters."""
    torch.set_num_threads(1)
    mesh = tm.init_mesh(cp=cp) if cp > 1 else Mesh.build(1, 1, 1, torch.device("cpu"))
    model = Llama(dataclasses.replace(preset("llama-tiny"), rope_scaling=scaling), seed=0).double()
    model = tm.parallelize(model, mesh, precision="fp64")
    opt = tm.optimizer(model, lr=3e-3)
    tokens = torch.randint(0, 256, (2, 2, 65), generator=torch.Generator().manual_seed(1))
    losses = [tm.train_step(model, opt, (t[:, :-1], t[:, 1:])) for t in tokens]
    return losses, model.state_dict()


def test_a_llama3_scaled_llama_at_cp2_ring_matches_one_process():
    reference = _train(LLAMA3, 1)
    assert abs(reference[0][0] - _train(None, 1)[0][0]) > 1e-6  # the scaling changes the first step's loss
    parallel = run_ranks(_train, 2, LLAMA3, 2, timeout=120)[0]
    EQUIVALENCE_TABLE.append(("cp2 ring api llama-tiny llama3 rope", *assert_same_training(reference, parallel)))
