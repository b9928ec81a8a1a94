"""Published kernel measurements the step-time model prices from, cited in docs/planner.md ("Kernel curves"):
:data:`ATTENTION`, fused attention TFLOP/s on an H100 by head dimension and length (FlashAttention-2, cuDNN,
FlashAttention-3 [FA3: Shah et al., arXiv 2407.08608, Fig. 5-6]); :data:`GROUPED_ROWS`, a grouped expert matmul's
rate by rows per expert [DeepGEMM README, H800]; :data:`DEEPEP_NVLINK` and :data:`DEEPEP_RDMA`, a
forwarding dispatch's bandwidths [DeepEP README, H800]; :func:`busiest_expert_rank`, the ep load spread."""

from __future__ import annotations

import bisect
import math

# Sequence lengths of the FlashAttention-3 benchmarks (batch x sequence = 16K tokens, 2048 wide) [FA3, 4.1].
SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)

# kernel -> head dim -> (causal forward, non-causal forward, backward) TFLOP/s at SEQUENCES, H100 SXM5, bf16
# [FA3, Figure 5 (forward, causal and not) and Figure 6 (backward, without causal mask)]. FLOPs as the
# papers count them: a causal forward is half of 4 s^2 d h, the backward 2.5 times its forward.
ATTENTION: dict[str, dict[int, tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]]] = {
    "fa2": {64: ((180, 229, 262, 284, 295, 299), (282, 306, 318, 321, 322, 324), (198, 238, 264, 279, 287, 291)),
            128: ((191, 260, 298, 319, 333, 335), (309, 350, 362, 368, 370, 370), (214, 260, 291, 310, 318, 322))},
    "cudnn": {64: ((225, 288, 334, 363, 379, 388), (335, 373, 395, 408, 412, 413), (266, 348, 395, 417, 432, 433)),
              128: ((315, 410, 484, 518, 529, 539), (497, 574, 617, 609, 600, 595), (305, 408, 465, 499, 518, 516))},
    "fa3": {64: ((197, 265, 371, 420, 460, 473), (333, 392, 460, 476, 496, 497), (272, 363, 422, 453, 472, 474)),
            128: ((292, 423, 521, 579, 602, 616), (467, 565, 625, 638, 646, 648), (316, 424, 501, 542, 559, 561))},
}
ATTENTION_PEAK = 989e12  # the H100 SXM5's dense bf16 peak the curves were measured against
BACKWARD_FLOPS = 2.5  # an attention backward's FLOPs per forward FLOP (five matmuls against two) [FA2, 3.1]

# Rows per expert -> a grouped matmul's rate over its rate at 8,192 rows per expert: DeepGEMM's FP8 grouped GEMMs on
# an H800 [DeepGEMM README, "Grouped GEMMs for MoE models", contiguous layout at 8192 and 4096 rows, masked at 1024,
# 512 and 256], the mean of its two DeepSeek-V3 expert shapes (N 4096 K 7168: 1297, 1288, 1233, 1040, 932 TFLOP/s;
# N 7168 K 2048: 1099, 1093, 925, 916, 815): the row tiles a small group leaves part empty.
GROUPED_ROWS = ((256, 0.730), (512, 0.818), (1024, 0.896), (4096, 0.994), (8192, 1.0))

# DeepEP's normal (training) kernels, dispatch in FP8 and combine in bf16, on H800 with one CX7 400 Gb/s NIC a GPU
# (~50 GB/s) and ~160 GB/s of NVLink at most, 4096 tokens of 7168 a rank, top-8 within 4 groups, on 24 SMs [DeepEP
# README, V1 "Normal kernels with NVLink and RDMA forwarding", docs/legacy.md since V2]: bottleneck bandwidth
# (dispatch, combine) over NVLink within a node of 8 (153, 158 GB/s) as a share of the H800's datasheet 200 GB/s a
# direction, over RDMA by ep (16: 43, 43; 32: 58, 57; 64: 51, 50 GB/s) as a share of the NIC's 50 GB/s.
DEEPEP_NVLINK = (153 / 200, 158 / 200)
DEEPEP_RDMA = ((16, 43 / 50, 43 / 50), (32, 58 / 50, 57 / 50), (64, 51 / 50, 50 / 50))


def grouped_rows_share(rows: float) -> float:
    """A grouped expert matmul's rate at ``rows`` per expert over its large-group rate (:data:`GROUPED_ROWS`),
    interpolated in log rows; flat beyond the measured ends."""
    return _interpolate(GROUPED_ROWS, rows)


def deepep_shares(ep: int, combine: bool) -> tuple[float, float]:
    """(NIC share, NVLink share) of DeepEP's normal kernels' measured bottleneck bandwidth for a dispatch (or a
    ``combine``) over ``ep`` ranks (:data:`DEEPEP_RDMA`, interpolated in log ep, flat beyond the measured ends)."""
    i = 2 if combine else 1
    return _interpolate(tuple((p[0], p[i]) for p in DEEPEP_RDMA), ep), DEEPEP_NVLINK[i - 1]


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise linear in log2(x) through ``points`` (sorted by x), flat beyond both ends."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
    return y0 + w * (y1 - y0)


def attention_rates(kernel: str, head_dim: int, seq: int) -> tuple[float, float]:
    """(forward, backward) FLOP/s of a causal fused attention core on an H100 at ``head_dim`` and ``seq`` keys,
    interpolated; the causal backward is the non-causal rate times the forward's causal / non-causal ratio."""
    table = ATTENTION[kernel]

    def at(d: int) -> tuple[float, float]:
        causal, full, backward = (tuple(zip(SEQUENCES, c)) for c in table[d])
        fwd = _interpolate(causal, seq)
        return fwd, _interpolate(backward, seq) * fwd / _interpolate(full, seq)

    lo, hi = at(64), at(128)
    w = min(1.0, max(0.0, (head_dim - 64) / 64))
    return tuple(1e12 * (a + w * (b - a)) for a, b in zip(lo, hi))  # type: ignore[return-value]


def busiest_expert_rank(ep: int, copies: float) -> float:
    """Load of the busiest of ``ep`` ranks over the mean when ``copies`` fall uniformly at random: binomial counts,
    whose maximum lies about sqrt(2 ln ep) standard deviations above the mean. 1 without expert parallelism."""
    if ep <= 1 or copies <= 0:
        return 1.0
    mean = copies / ep
    return 1.0 + math.sqrt(2 * math.log(ep)) * math.sqrt(mean * (1 - 1 / ep)) / mean
