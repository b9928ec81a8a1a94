"""Shared memory among the ranks of one host: the all-reduce gives the same sums as Gloo's, in rank order,
divided as asked, with Gloo taking over where the ranks are not on one host or cannot make the segment, and
a rank that never comes to a sum makes the others' time out naming it; all-gathers and reduce-scatters give
each rank its part; a channel delivers messages in the order their receives were posted and times out naming
the message, and opening channels fails as a named collective; ``TRAINMESH_HOST_TRANSPORT=off`` keeps every
sum on Gloo, and a value other than auto or off is refused naming the variable."""

import errno
import functools
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainmesh.distributed.comm
from trainmesh.distributed import shm
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.mesh import Mesh, init_distributed
from trainmesh.distributed.launcher import launch
from trainmesh.distributed.testing import RankFailure, run_ranks

PER_CHUNK = shm.SLOT_BYTES // 4
CASES = [  # (numel, dtype, divisor): several chunks with a short last one, uneven rank slices, half precision,
    # small, a gradient norm's one square
    (2 * PER_CHUNK + 12_345, torch.float32, 1),
    (300_001, torch.float64, 1),
    (700_001, torch.bfloat16, 1),
    (1_000, torch.float32, 3),
    (1, torch.float64, 1),
]


@pytest.fixture(autouse=True)
def _host_transport(monkeypatch):
    """These tests are about the shared segment, which the suite otherwise turns off (``conftest.py``)."""
    monkeypatch.setenv(shm.TRANSPORT_ENV, "auto")


def _tensor(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel)).to(dtype)


def _sum_cases(obstacle: str) -> tuple[list[torch.Tensor], bool]:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if obstacle == "hosts":  # every rank claims a host of its own
        shm._host_id = lambda: f"host-{rank}"
    elif obstacle == "no /dev/shm" and rank == 0:  # the segment cannot be created
        shm.SHM_DIR = Path("/nonexistent/shm")
    elif obstacle == "full /dev/shm" and rank == 0:  # its space cannot be reserved (a write would SIGBUS)
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")
        shm.os.posix_fallocate = full
    elif obstacle == "transport off":
        os.environ[shm.TRANSPORT_ENV] = "off"
    init_distributed("gloo", torch.device("cpu"))
    comm = Comm(Mesh.build(1, dist.get_world_size(), 1, torch.device("cpu")))
    sums = []
    for numel, dtype, divisor in CASES:
        t = _tensor(rank, numel, dtype)
        comm.all_reduce(t, "dp", async_op=True, divisor=divisor).wait()
        sums.append(t)
    return sums, comm.transport == "shm+torch.distributed"


@pytest.mark.parametrize("world", [2, 3])
def test_host_all_reduce_gives_every_rank_the_rank_ordered_sum_and_leaves_no_file(world):
    before = set(shm.SHM_DIR.glob("trainmesh-*"))
    results = run_ranks(_sum_cases, world, "", timeout=120)
    assert all(through_host for _, through_host in results)
    for i, (numel, dtype, divisor) in enumerate(CASES):
        expected = functools.reduce(torch.add, [_tensor(r, numel, dtype) for r in range(world)]) / divisor
        for sums, _ in results:
            assert torch.equal(sums[i], expected), f"{numel} x {dtype} / {divisor}"
    assert set(shm.SHM_DIR.glob("trainmesh-*")) == before


GATHER_CASES = [  # (numel per rank, dtype): several chunks of either collective, uneven, half precision, tiny
    (PER_CHUNK + 12_345, torch.float32),
    (3_001, torch.bfloat16),
    (1, torch.float64),
]


def _gather_scatter_cases() -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
    """Each rank all-gathers its shard, and reduce-scatters its full tensor (divided by 3)."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    init_distributed("gloo", torch.device("cpu"))
    world = dist.get_world_size()
    comm = Comm(Mesh.build(1, world, 1, torch.device("cpu")))
    gathered, scattered = [], []
    for numel, dtype in GATHER_CASES:
        out = torch.empty(world * numel, dtype=dtype)
        comm.all_gather(out, _tensor(rank, numel, dtype), "dp")
        gathered.append(out)
        mine = torch.empty(numel, dtype=dtype)
        comm.reduce_scatter(mine, _tensor(rank, world * numel, dtype), "dp", divisor=3)
        scattered.append(mine)
    return gathered, scattered, comm.transport == "shm+torch.distributed"


@pytest.mark.parametrize("world", [2, 3])
def test_host_all_gather_and_reduce_scatter_give_each_rank_its_part_in_rank_order(world):
    results = run_ranks(_gather_scatter_cases, world, timeout=120)
    for i, (numel, dtype) in enumerate(GATHER_CASES):
        shards = torch.cat([_tensor(r, numel, dtype) for r in range(world)])
        sums = functools.reduce(torch.add, [_tensor(r, world * numel, dtype) for r in range(world)]) / 3
        for rank, (gathered, scattered, through_host) in enumerate(results):
            assert through_host
            assert torch.equal(gathered[i], shards), f"all-gather {numel} x {dtype}"
            assert torch.equal(scattered[i], sums[rank * numel:(rank + 1) * numel]), f"reduce-scatter {numel} x {dtype}"


@pytest.mark.parametrize("obstacle", ["hosts", "no /dev/shm", "full /dev/shm", "transport off"])
def test_ranks_on_different_hosts_or_without_a_segment_sum_through_gloo(obstacle):
    before = set(shm.SHM_DIR.glob("trainmesh-*"))
    results = run_ranks(_sum_cases, 2, obstacle, timeout=120)
    assert not any(through_host for _, through_host in results)
    assert set(shm.SHM_DIR.glob("trainmesh-*")) == before
    for i, (numel, dtype, divisor) in enumerate(CASES):
        expected = (_tensor(0, numel, dtype).double() + _tensor(1, numel, dtype).double()) / divisor
        torch.testing.assert_close(results[0][0][i].double(), expected, atol=0.02 if dtype == torch.bfloat16 else 1e-5,
                                   rtol=0.02 if dtype == torch.bfloat16 else 1e-5)


def _exchange(depth: int, timeout_s: float) -> tuple[list[float], str]:
    """Rank 0 sends three tensors (two batches) through a channel ``depth`` deep; rank 1 posts their three
    receives at once and waits for them last first. Then each waits for a message the other never sends."""
    torch.set_num_threads(1)
    init_distributed("gloo", torch.device("cpu"))
    mesh = Mesh.build(2, 1, 1, torch.device("cpu"), timeout_s=timeout_s)
    comm, rank = Comm(mesh), dist.get_rank()
    assert comm.open_channels("pp", [(0, 1), (1, 0)], depth, 4 * 1000)
    sent = [torch.full((1000,), float(i)) for i in range(3)]
    buffers = [torch.empty(1000) for _ in sent]
    if rank == 0:
        for batch in (sent[:2], sent[2:]):
            for work in comm.send_recv([(t, 1) for t in batch], []):
                work.wait()
    else:
        for work in reversed(comm.send_recv([], [(b, 0) for b in buffers])):
            work.wait()
    try:
        comm.send_recv([], [(torch.empty(1000), 1 - rank)])[0].wait()
    except Exception as e:  # noqa: BLE001 - the test checks its message
        return [b[0].item() for b in buffers], str(e)
    return [b[0].item() for b in buffers], "no error"


@pytest.mark.parametrize("depth", [1, 3])
def test_a_channel_fills_receives_in_the_order_they_were_posted_and_times_out_naming_the_message(depth):
    """A receive waited for before an earlier one still gets its own message (the earlier one is filled on
    the way); a full ring holds the sender back until the receiver drains it; a message that never comes
    fails after the mesh's timeout with the message's number."""
    (_, error0), (values, error1) = run_ranks(_exchange, 2, depth, 2.0, timeout=60)
    assert values == [0.0, 1.0, 2.0]
    assert error0.startswith("rank 0: p2p pp/recv 1->0 #1 failed: Timed out waiting 2000ms"), error0
    assert error1.startswith("rank 1: p2p pp/recv 0->1 #4 failed: Timed out waiting 2000ms"), error1


def _sum_alone(timeout_s: float) -> str:
    """Both ranks sum once (which maps the segment); then rank 0 sums again, alone, while rank 1 waits as long
    before it leaves (its exit waits for rank 0 under the same timeout)."""
    torch.set_num_threads(1)
    init_distributed("gloo", torch.device("cpu"))
    comm = Comm(Mesh.build(1, 2, 1, torch.device("cpu"), timeout_s=timeout_s))
    comm.all_reduce(torch.ones(4), "dp")
    if dist.get_rank() == 1:
        time.sleep(timeout_s)
        return "no error"
    try:
        comm.all_reduce(torch.ones(4), "dp", op="grad_norm")
    except Exception as e:  # noqa: BLE001 - the test checks its message
        return str(e)
    return "no error"


def test_a_sum_a_peer_never_joins_times_out_naming_it():
    """The segment's barrier waits the mesh's timeout for a peer, then fails like a Gloo collective would:
    with the collective's name and number."""
    error, _ = run_ranks(_sum_alone, 2, 2.0, timeout=60)
    assert "dp/grad_norm" in error and "Timed out waiting 2000ms" in error, error


def _open_channels_failing() -> str:
    """Both ranks open channels whose mapping fails at once, as a Gloo collective inside it would fail when a
    peer stopped."""
    init_distributed("gloo", torch.device("cpu"))
    comm = Comm(Mesh.build(2, 1, 1, torch.device("cpu")))

    def stuck(*args: object) -> None:
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    trainmesh.distributed.comm.open_channels = stuck
    try:
        comm.open_channels("pp", [(0, 1), (1, 0)], 1, 64)
    except Exception as e:  # noqa: BLE001 - the test checks its message
        return str(e)
    return "no error"


def test_a_rank_failing_while_it_opens_channels_names_the_collective():
    """Mapping the channels' segment is a collective: a rank stuck there says which, as in any collective."""
    for rank, error in enumerate(run_ranks(_open_channels_failing, 2, timeout=60)):
        assert error.startswith(f"rank {rank}: collective pp/open_channels #1 (ranks 0-1) failed: Timed out"), error


def _segment_failing() -> str:
    """Both ranks fail in the collective right after the first one created the segment's file, as they
    would when a peer stopped there."""
    init_distributed("gloo", torch.device("cpu"))

    def stuck(ok: bool, group: object) -> bool:
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    shm._agree = stuck
    try:
        shm.open_segment(dist.group.WORLD, 4096)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_segment_whose_opening_fails_leaves_no_file():
    """A file left in /dev/shm keeps its memory until reboot (32 MiB a segment for 2 ranks)."""
    before = set(shm.SHM_DIR.glob("trainmesh-*"))
    errors = run_ranks(_segment_failing, 2, timeout=60)
    assert all("Timed out" in e for e in errors), errors
    assert set(shm.SHM_DIR.glob("trainmesh-*")) == before


KILLED_AFTER_CREATING = """
# Rank 0 is killed right after creating the segment's file, before the ranks could unlink it.
import os, signal, torch, torch.distributed as dist
from trainmesh.distributed import shm
from trainmesh.distributed.mesh import init_distributed
init_distributed("gloo", torch.device("cpu"))
if dist.get_rank() == 0:
    shm._agree = lambda ok, group: os.kill(os.getpid(), signal.SIGKILL)
shm.open_segment(dist.group.WORLD, 4096)
"""


def _killed_after_creating() -> None:
    exec(KILLED_AFTER_CREATING, {})


def test_what_started_the_ranks_removes_the_file_of_a_segment_whose_creator_was_killed(tmp_path):
    """The tests' run_ranks and the launcher each name the segments after their job and remove what is left."""
    before = set(shm.SHM_DIR.glob("trainmesh-*"))
    with pytest.raises(RankFailure, match="rank 0 failed"):
        run_ranks(_killed_after_creating, 2, timeout=60)
    assert set(shm.SHM_DIR.glob("trainmesh-*")) == before
    script = tmp_path / "killed.py"
    script.write_text(KILLED_AFTER_CREATING)
    assert launch([], 2, program=(str(script),)) != 0
    assert set(shm.SHM_DIR.glob("trainmesh-*")) == before
