"""What every benchmark shares: a trainmesh step, and timed rounds alternating between implementations.

Benchmarks run a trainmesh parallel form and its PyTorch counterpart in one run and print figures.

Both implementations train the same model on the same batches on the same ranks. Timed rounds alternate
between them, so slow drift of the machine (other load, thermal state) hits both alike; the figure is
tokens per second over all timed steps. Nothing here asserts a speed: benchmarks print, tests check.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trainmesh.run import Run
from trainmesh.train import forward_backward, rank_batch

StepFn = Callable[[int], None]


def trainmesh_step(run: Run) -> StepFn:
    def step(i: int) -> None:
        forward_backward(run, rank_batch(run, run.data.train, i, run.cfg.global_batch))
        run.engine.step(run.cfg.lr, run.cfg.grad_clip)

    return step


def _timed(step: StepFn, first: int, count: int, device: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(first, first + count):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - t0


def compare(steps: dict[str, StepFn], tokens_per_step: int, rounds: int, steps_per_round: int,
            device: torch.device) -> dict[str, float]:
    """Tokens/s of each step function over alternating timed rounds, after one warm-up round each."""
    elapsed = dict.fromkeys(steps, 0.0)
    for step in steps.values():
        _timed(step, 0, 2, device)
    for r in range(rounds):
        for name, step in steps.items():
            elapsed[name] += _timed(step, 2 + r * steps_per_round, steps_per_round, device)
    return {name: tokens_per_step * rounds * steps_per_round / t for name, t in elapsed.items()}
