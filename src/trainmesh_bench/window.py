"""Sliding-window attention against full causal attention: the attention core alone, forward and backward, at
sequence 4096 with Mistral's window cut to 512 and mistral-7b's head dim (4 heads, to keep CPU time sane),
measured (median of paired runs' ratios) next to the planner's predicted ratio of the two cores' times.

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

SEQ, WINDOW, HEADS, RUNS = 4096, 512, 4, 9
HEAD_DIM = core_width(model_shape("mistral-7b"))[0]


def pair_seconds(cores: tuple[AttentionCore, AttentionCore]) -> list[tuple[float, float]]:
    """``RUNS`` pairs of one forward and backward of each core over ``SEQ`` positions, back to back so the
    machine's drift hits both alike (as :mod:`trainmesh_bench.common` pairs steps)."""
    q, k, v = (torch.randn(1, HEADS, SEQ, HEAD_DIM, requires_grad=True) for _ in range(3))
    pairs = []
    for _ in range(RUNS):
        times = []
        for core in cores:
            start = time.perf_counter()
            core(q, k, v).sum().backward()
            times.append(time.perf_counter() - start)
        pairs.append((times[0], times[1]))
    return pairs


def predicted_ratio() -> float:
    """The planner's windowed / full attention-core FLOPs for mistral-7b at ``SEQ``: its core times' ratio, both
    cores priced as matmuls of the same shape."""
    shape = model_shape("mistral-7b")
    flops = [block_gemms(Workload(dataclasses.replace(shape, sliding_window=w), 1, SEQ), Layout())["attention"].flops
             for w in (WINDOW, None)]
    return flops[0] / flops[1]


def main() -> None:
    torch.manual_seed(0)
    pairs = pair_seconds((AttentionCore(None), AttentionCore(WINDOW)))
    ratios = sorted(windowed / full for full, windowed in pairs)
    print(f"attention core fwd+bwd, seq {SEQ}, {HEADS} heads of {HEAD_DIM}, {torch.get_num_threads()} threads, "
          f"{RUNS} pairs")
    print(f"full {statistics.median(p[0] for p in pairs) * 1e3:.0f} ms  window {WINDOW} "
          f"{statistics.median(p[1] for p in pairs) * 1e3:.0f} ms  measured ratio {statistics.median(ratios):.3f} "
          f"({ratios[0]:.3f}-{ratios[-1]:.3f})  planner ratio {predicted_ratio():.3f}")


if __name__ == "__main__":
    main()
