"""ZeRO's per-rank memory and communication as formulas [ZeRO §3.1, §5, §7.2-7.3].

The planner prices a layout with them before any process starts, and the tests check the engines'
measured bytes against them, so both sides state one model of ZeRO. Which state each stage shards is
:func:`trainmesh.training.state_bytes.sharded_state_bytes`, the rule the planner's memory model uses too.
"""

from __future__ import annotations

from trainmesh.training.state_bytes import Precision, sharded_state_bytes


def model_state_bytes_formula(psi: int, n: int, stage: int, mixed_precision: bool = False,
                              grad_bytes: int | None = None) -> float:
    """Parameters + gradients + optimizer state held per rank [ZeRO §3.1, §5.1-5.3, Fig. 1].

    Mixed precision holds (2 + 2 + K)Ψ with K = 12 (fp32 master weights, momentum, variance); stage 1
    divides the K term by N (4Ψ + 12Ψ/N), stage 2 also the gradients (2Ψ + 14Ψ/N), stage 3 also the
    parameters (16Ψ/N). In fp32 the parameters are the master weights, so (4 + 4 + 8)Ψ: 16Ψ,
    8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.

    ``grad_bytes`` is the size of a gradient element, the reduce dtype's; the paper's 2 (bf16/fp16) in
    mixed precision unless given. With the fp32 reduce dtype (trainmesh's default) the gradient term is
    4Ψ: 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N, 18Ψ/N.
    """
    params, optim = (2, 12) if mixed_precision else (4, 8)
    grads = grad_bytes if grad_bytes is not None else params
    return sum(sharded_state_bytes(psi, psi / n, stage, Precision(params, grads, optim, params)))


def step_comm_bytes_formula(psi: int, n: int, stage: int, element_size: int = 4, microbatches: int = 1) -> float:
    """Bytes each rank sends over ``dp`` in one optimizer step, ring volumes [ZeRO §7.2-7.3].

    DP all-reduces the gradients once: 2Ψ(N-1)/N. Stage 1 reduce-scatters them once and all-gathers
    the updated parameters: the same 2Ψ(N-1)/N. Stage 2 reduce-scatters every micro-batch. Stage 3
    gathers the parameters before each forward and each backward and reduce-scatters the gradients,
    3Ψ(N-1)/N per micro-batch: 1.5x DP.
    """
    one_pass = element_size * psi * (n - 1) / n
    return one_pass * {0: 2, 1: 2, 2: microbatches + 1, 3: 3 * microbatches}[stage]

