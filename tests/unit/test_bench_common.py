"""The benchmarks' timing: pairs of single steps, one of each implementation on the same batch, the order
reversed from pair to pair; the figure is the median of the per-pair ratios."""

import torch

from trainmesh_bench import common
from trainmesh_bench.common import Result, compare


def test_compare_times_one_step_of_each_per_pair_on_the_same_batch_in_alternating_order(monkeypatch):
    monkeypatch.setattr(common.dist, "barrier", lambda: None)
    calls: list[tuple[str, int]] = []
    steps = {name: (lambda i, name=name: calls.append((name, i))) for name in ("ours", "peer")}
    rates = compare(steps, tokens_per_step=100, pairs=4, device=torch.device("cpu"), warmup=1)
    timed = calls[2:]  # one warm-up step each first
    assert calls[:2] == [("ours", 0), ("peer", 0)]
    assert timed == [("ours", 2), ("peer", 2), ("peer", 3), ("ours", 3),
                     ("ours", 4), ("peer", 4), ("peer", 5), ("ours", 5)]
    assert [len(r) for r in rates.values()] == [4, 4] and all(r > 0 for r in rates["ours"])


def test_the_ratio_is_the_median_of_the_per_pair_ratios_with_their_range():
    ours = [110.0, 110.0, 20.0, 110.0, 110.0]  # the third pair's step of ours was disturbed
    result = Result("dp", "ours", "peer", ours, [100.0] * 5)
    assert result.summary()["ratio_median"] == 1.1 and result.summary()["ratio_min"] == 0.2
    assert "ratio 1.100 (0.200-1.100)" in result.line()
