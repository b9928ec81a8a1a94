"""Sliding-window and document-masked attention against full causal attention: the attention core alone, forward
and backward, at sequence 4096 with mistral-7b's head dim (4 heads, to keep CPU time sane): Mistral's window cut to
512, and documents of 256 to 1024 tokens (seeded lengths, the last one cut at the sequence's end). Each is measured
(median of paired runs' ratios) next to the planner's predicted ratio of the two cores' times.

``python -m trainmesh_bench.window`` (``make bench-window``); figures in docs/performance.md."""
from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable

import torch

from trainmesh.layout import Layout
from trainmesh.models.cache import causal_attention
from trainmesh.models.llama import AttentionCore
from trainmesh.plan.flops import core_width
from trainmesh.plan.presets import model_shape
from trainmesh.plan.timing import block_gemms
from trainmesh.plan.workload import Workload

SEQ, WINDOW, HEADS, RUNS = 4096, 512, 4, 9
DOCUMENTS = (256, 1024)  # shortest and longest document
HEAD_DIM = core_width(model_shape("mistral-7b"))[0]

Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def pair_seconds(cores: tuple[Core, Core]) -> list[tuple[float, float]]:
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


def document_lengths(seed: int = 0) -> tuple[int, ...]:
    """Documents of uniformly drawn lengths packed into ``SEQ`` tokens, the last one cut at the end."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < SEQ:
        lengths.append(min(rng.randint(*DOCUMENTS), SEQ - sum(lengths)))
    return tuple(lengths)


def predicted_ratio(window: int | None, documents: tuple[int, ...] = ()) -> float:
    """The planner's masked / full attention-core FLOPs for mistral-7b's shape at ``SEQ``: its core times' ratio,
    both cores priced as matmuls of the same shape."""
    shape = dataclasses.replace(model_shape("mistral-7b"), sliding_window=window)
    plain = dataclasses.replace(shape, sliding_window=None)
    flops = [block_gemms(Workload(s, 1, SEQ, documents=d), Layout())["attention"].flops
             for s, d in ((shape, documents), (plain, ()))]
    return flops[0] / flops[1]


def report(name: str, pairs: list[tuple[float, float]], predicted: float) -> None:
    """The median times, the median and range of the pairs' masked / full ratios, and the planner's ratio."""
    ratios = sorted(masked / full for full, masked in pairs)
    print(f"{name}: full {statistics.median(p[0] for p in pairs) * 1e3:.0f} ms  masked "
          f"{statistics.median(p[1] for p in pairs) * 1e3:.0f} ms  measured ratio {statistics.median(ratios):.3f} "
          f"({ratios[0]:.3f}-{ratios[-1]:.3f}), {1 / statistics.median(ratios):.2f}x the throughput  "
          f"planner ratio {predicted:.3f}")


def main() -> None:
    torch.manual_seed(0)
    lengths = document_lengths()
    documents = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)]])
    print(f"attention core fwd+bwd, seq {SEQ}, {HEADS} heads of {HEAD_DIM}, {torch.get_num_threads()} threads, "
          f"{RUNS} pairs")
    report(f"window {WINDOW}", pair_seconds((AttentionCore(None), AttentionCore(WINDOW))), predicted_ratio(WINDOW))
    report(f"{len(lengths)} documents {lengths}",
           pair_seconds((causal_attention, lambda q, k, v: causal_attention(q, k, v, documents=documents))),
           predicted_ratio(None, lengths))


if __name__ == "__main__":
    main()
