"""``make bench-documents``: the cp ring over packed documents (a window of 4096 tokens cut into documents of 256 to
1024), each rank's attention compute time (forward + backward, from the ring's timeline) with the shards
:func:`~trainmesh.parallel.context_parallel.balanced_shards` deals and with the head-tail pair of one causal sequence.
Prints the spread from perfect balance, (slowest rank - mean) / mean; asserts nothing."""

from __future__ import annotations

import argparse
import statistics

import torch

from trainmesh import api
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.mesh import world_env
from trainmesh.distributed.testing import run_ranks
from trainmesh.models.documents import Packing, document_positions, packed
from trainmesh.parallel.context_parallel import (RingTimeline, balanced_shards, chunk_starts, chunk_work,
                                                 held_positions, ring_attention)

LENGTHS = (256, 384, 512, 640, 768, 896, 1024)
HEADS, HEAD_DIM = 8, 64
REPEATS = 7  # timed repetitions after one warm-up; the fastest per rank is quoted (the least disturbed by the host)


def packed_documents(seq_len: int, batch: int, seed: int) -> torch.Tensor:
    """``[batch, seq_len]`` document indices of documents whose lengths are drawn from :data:`LENGTHS`."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        sizes: list[int] = []
        while sum(sizes) < seq_len:
            sizes.append(LENGTHS[int(torch.randint(len(LENGTHS), (1,), generator=gen))])
        rows.append(torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))[:seq_len])
    return torch.stack(rows)


def assignments(documents: torch.Tensor, cp: int) -> dict[str, tuple[tuple[tuple[int, ...], ...], int]]:
    """The balanced shards and the head-tail pair, as (each rank's chunk starts, chunk size)."""
    seq = documents.shape[1]
    head_tail = tuple(tuple(chunk_starts(seq, cp, r)) for r in range(cp))
    return {"balanced": balanced_shards(documents, cp), "head-tail": (head_tail, seq // (2 * cp))}


def _compute_seconds(documents: torch.Tensor, shards, chunk: int, comm: Comm, seed: int) -> float:
    """This rank's fastest compute seconds (forward and backward) of the ring over ``documents`` held as ``shards``."""
    cp, rank = comm.mesh.size("cp"), comm.mesh.rank("cp")
    batch, seq = documents.shape
    held = held_positions(shards[rank], chunk)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, HEADS, seq, HEAD_DIM, generator=gen)[:, :, held] for _ in range(3))
    packing = Packing(documents, document_positions(documents)[:, held], shards, chunk)
    times = []
    for _ in range(REPEATS + 1):
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        timeline = RingTimeline()
        with packed(packing):
            ring_attention(*local, comm, timeline=timeline).sum().backward()
        times.append(timeline.total("compute"))
    assert cp == len(shards)
    return min(times[1:])


def documents_rank(seq_len: int, batch: int, seed: int) -> dict[str, float]:
    """On every cp rank: its compute seconds under each assignment."""
    comm = Comm(api.init_mesh(cp=world_env().world_size))
    documents = packed_documents(seq_len, batch, seed)
    return {name: _compute_seconds(documents, shards, chunk, comm, seed)
            for name, (shards, chunk) in assignments(documents, comm.mesh.size("cp")).items()}


def spread(values: list[float]) -> float:
    """(largest - mean) / mean: 0 is perfect balance."""
    mean = statistics.fmean(values)
    return (max(values) - mean) / mean


def report(seq_len: int, batch: int, seed: int, per_rank: list[dict[str, float]]) -> str:
    documents = packed_documents(seq_len, batch, seed)
    cp = len(per_rank)
    lines = [f"cp{cp} ring, {batch} window(s) of {seq_len} tokens, documents of {LENGTHS[0]}-{LENGTHS[-1]} tokens, "
             f"{HEADS} heads of {HEAD_DIM}, fp32; attention compute per rank (forward + backward, fastest of "
             f"{REPEATS}):",
             f"{'shards':<12}{'chunk':>6}{'counted blocks per rank':>26}{'seconds per rank':>26}{'from balance':>14}"]
    for name, (shards, chunk) in assignments(documents, cp).items():
        work = chunk_work(documents, chunk)
        blocks = [sum(work[s // chunk] for s in starts) for starts in shards]
        seconds = [r[name] for r in per_rank]
        lines.append(f"{name:<12}{chunk:>6}{' '.join(str(b) for b in blocks):>26}"
                     f"{' '.join(f'{s:.3f}' for s in seconds):>26}{spread(seconds):>13.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="windows a micro-batch holds")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="draws the document lengths and the inputs")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    per_rank = run_ranks(documents_rank, args.cp, args.seq_len, args.batch, args.seed, timeout=args.timeout)
    print(report(args.seq_len, args.batch, args.seed, per_rank))


if __name__ == "__main__":
    main()
