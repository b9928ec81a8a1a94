"""Sliding-window attention against full causal attention: the attention core alone, forward and backward, at
sequence 4096 with Mistral's window cut to 512 and mistral-7b's head dim (4 heads, to keep CPU time sane),
measured (median of runs) next to the planner's predicted ratio of the two cores' times.

``python -m trainmesh_bench.window`` (``make bench-window``); figures in docs/performance.md."""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from trainmesh.models.llama import AttentionCore
from trainmesh.layout import Layout
from trainmesh.plan.flops import core_width
from trainmesh.plan.presets import model_shape
from trainmesh.plan.timing import block_gemms
from trainmesh.plan.workload import Workload

SEQ, WINDOW, HEADS, RUNS = 4096, 512, 4, 5
HEAD_DIM = core_width(model_shape("mistral-7b"))[0]


def core_seconds(window: int | None) -> float:
    """Median seconds of one forward and backward of the attention core over ``SEQ`` positions."""
    q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, requires_grad=True) for _ in range(3))
    core, times = AttentionCore(window), []
    for _ in range(RUNS):
        start = time.perf_counter()
        core(q, k, v).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def predicted_ratio() -> float:
    """The planner's windowed / full attention-core FLOPs for mistral-7b at ``SEQ``: its core times' ratio, both
    cores priced as matmuls of the same shape."""
    shape = model_shape("mistral-7b")
    flops = [block_gemms(Workload(dataclasses.replace(shape, sliding_window=w), 1, SEQ), Layout())["attention"].flops
             for w in (WINDOW, None)]
    return flops[0] / flops[1]


def main() -> None:
    torch.manual_seed(0)
    full, windowed = core_seconds(None), core_seconds(WINDOW)
    print(f"attention core fwd+bwd, seq {SEQ}, {HEADS} heads of {HEAD_DIM}, "
          f"{torch.get_num_threads()} threads, median of {RUNS}")
    print(f"full {full * 1e3:.0f} ms  window {WINDOW} {windowed * 1e3:.0f} ms  measured ratio {windowed / full:.3f}  "
          f"planner ratio {predicted_ratio():.3f}")


if __name__ == "__main__":
    main()
