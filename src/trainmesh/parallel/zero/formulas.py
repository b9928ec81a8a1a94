"""ZeRO's per-rank memory and communication as formulas [ZeRO §3.1, §5, §7.2-7.3], shared by the planner
and the tests that check the engines' measured bytes."""

from __future__ import annotations

from trainmesh.training.state_bytes import Precision, sharded_state_bytes


def model_state_bytes_formula(psi: int, n: int, stage: int, mixed_precision: bool = False,
                              grad_bytes: int | None = None) -> float:
    """Parameters + gradients + optimizer state per rank [ZeRO §3.1, §5.1-5.3, Fig. 1]: (2 + 2 + K)Ψ with
    K = 12 in mixed precision, stage 1 dividing K by N, stage 2 also gradients, stage 3 also parameters; in
    fp32 (4 + 4 + 8)Ψ. ``grad_bytes`` is the reduce dtype's element size (2 unless given)."""
    params, optim = (2, 12) if mixed_precision else (4, 8)
    grads = grad_bytes if grad_bytes is not None else params
    return sum(sharded_state_bytes(psi, psi / n, stage, Precision(params, grads, optim, params)))


def step_comm_bytes_formula(psi: int, n: int, stage: int, element_size: int = 4, microbatches: int = 1) -> float:
    """Bytes each rank sends over ``dp`` per optimizer step, ring volumes [ZeRO §7.2-7.3]: DP and stage 1
    2Ψ(N-1)/N; stage 2 a reduce-scatter per micro-batch; stage 3 3Ψ(N-1)/N per micro-batch (1.5x DP)."""
    one_pass = element_size * psi * (n - 1) / n
    return one_pass * {0: 2, 1: 2, 2: microbatches + 1, 3: 3 * microbatches}[stage]

