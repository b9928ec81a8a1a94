"""What ``make bench-cp`` measures with: the search for the longest sequence under a memory cap (no
processes), and the ring's timeline of compute and waits (two ranks)."""

import pytest
import torch
import torch.nn.functional as F

from trainmesh import api
from trainmesh_bench import documents
from trainmesh_bench.cp import largest_fitting, longest_fitting, planned_peak
from trainmesh.distributed.comm import Comm, log_all_gather
from trainmesh.parallel.context_parallel import RingTimeline, ring_attention, shard_sequence
from trainmesh.distributed.testing import run_ranks

MIB = 2**20


@pytest.mark.parametrize("guess", [1, 64, 4096])
@pytest.mark.parametrize("limit", [0, 7, 8, 65, 1000, 5000])
def test_largest_fitting_finds_the_boundary_from_any_guess(limit: int, guess: int) -> None:
    probes = []

    def fits(n: int) -> bool:
        probes.append(n)
        return n <= limit

    assert largest_fitting(fits, 8, guess) == limit // 8 * 8
    assert all(p % 8 == 0 and p > 0 for p in probes)
    assert len(probes) == len(set(probes))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_planner_longest_sequence_is_the_last_that_fits(cp: int) -> None:
    cap = 160 * MIB
    seq = longest_fitting(cap, cp)
    assert seq % (2 * cp) == 0
    assert planned_peak(seq, cp) <= cap < planned_peak(seq + 2 * cp, cp)


def _timed_ring(seq: int) -> tuple[list, float]:
    """The ring with a timeline on 2 ranks (float64), and its largest output error against SDPA."""
    comm = Comm(api.init_mesh(cp=2))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    rank = comm.mesh.rank("cp")
    local = [shard_sequence(t.flatten(0, 1), 2, rank).view(1, 4, seq // 2, 8).requires_grad_() for t in (q, k, v)]
    timeline = RingTimeline()
    out = ring_attention(*local, comm, timeline=timeline)
    out.sum().backward()
    ref = shard_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True).flatten(0, 1), 2, rank)
    error = log_all_gather(torch.tensor([(out.detach().flatten(0, 1) - ref).abs().max().item()]))
    return timeline.events, float(error.max())


def test_ring_timeline_times_every_step_without_changing_the_result() -> None:
    for events, error in run_ranks(_timed_ring, 2, 32, timeout=120):
        assert error < 1e-12
        steps = [(phase, step, kind) for phase, step, kind, _ in events]
        assert steps == [("forward", 0, "compute"), ("forward", 0, "wait"), ("forward", 1, "compute"),
                         ("forward", 1, "wait"), ("backward", 0, "compute"), ("backward", 0, "wait"),
                         ("backward", 1, "compute"), ("backward", 1, "wait"), ("backward", 2, "wait")]
        assert all(seconds >= 0 for *_, seconds in events)


def test_the_documents_bench_times_each_rank_under_both_assignments(capsys) -> None:
    """``make bench-documents`` at a small size: a line per assignment, each rank's blocks and seconds."""
    documents.main(["--seq-len", "1024", "--cp", "2", "--timeout", "120"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["balanced", "head-tail"]
    assert all(line.endswith("%") and len(line.split()) == 7 for line in lines[2:])
