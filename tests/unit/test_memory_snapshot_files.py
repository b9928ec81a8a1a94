"""Memory snapshot files and choices without ranks: bytes refused unless whole and of this run, the newest
step every old rank's state survives at, ``auto``'s interval, and which files a cleanup deletes."""

import re
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainmesh.checkpoint import memory

RUN, OTHER = "a" * 32, "b" * 32


def _blob(run: str = RUN) -> bytes:
    return memory.encode({"run": run, "step": 3}, safetensors.torch.save({"w": torch.arange(4.0)}))


def test_a_whole_snapshot_decodes_to_its_header_and_tensors():
    header, tensors = memory.decode(_blob(), RUN, Path("x"))
    assert header["step"] == 3 and torch.equal(tensors["w"], torch.arange(4.0))


@pytest.mark.parametrize("damage, says", [
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "does not match its SHA-256 (corrupted)"),
    (lambda b: b[:20], "is not a trainmesh snapshot"),
    (lambda b: b"X" + b[1:], "is not a trainmesh snapshot"),
])
def test_a_damaged_snapshot_is_refused_naming_the_file(damage, says):
    with pytest.raises(memory.SnapshotDamaged, match=re.escape(says)):
        memory.decode(damage(_blob()), RUN, Path("/dev/shm/f"))


def test_another_runs_snapshot_is_refused():
    with pytest.raises(memory.SnapshotDamaged, match=f"belongs to run {OTHER}, not {RUN}"):
        memory.decode(_blob(OTHER), RUN, Path("f"))


def test_the_newest_step_every_old_rank_survives_at_is_chosen():
    # two new ranks over an old world of 2: old rank 1's step 5 is gone, so step 4 is the newest complete
    held = [{"0": [[5, 2], [4, 2]]}, {"1": [[4, 2]]}]
    assert memory._choose(held) == (4, 2)
    assert memory._choose([{"0": [[5, 2]]}, {"1": [[5, 2]]}]) == (5, 2)
    assert memory._choose([{"0": [[5, 2]]}, {}]) is None
    assert memory._choose([{"0": [[4, 2]], "1": [[4, 2]]}, {"0": [[7, 1]]}]) == (7, 1)  # a later, smaller world


@pytest.mark.parametrize("snapshot_s, step_s, every", [(0.01, 1.0, 1), (0.1, 1.0, 1), (0.2, 1.0, 2),
                                                       (0.205, 0.155, 14), (0.5, 0.0, 1)])
def test_auto_snapshots_every_n_steps_keeping_the_cost_within_a_tenth(snapshot_s, step_s, every):
    assert memory.snapshot_every(snapshot_s, step_s) == every


def test_a_cleanup_deletes_this_runs_older_snapshots_and_leaves_others(tmp_path):
    names = [memory.segment(tmp_path, RUN, r, s, k).name for r in (0, 1) for s in (3, 4, 5) for k in ("own", "peer")]
    half_written = f".tmp-{memory.segment(tmp_path, RUN, 0, 6, 'own').name}"
    kept_apart = [memory.segment(tmp_path, OTHER, 0, 1, "own").name, "unrelated"]
    for name in [*names, half_written, *kept_apart]:
        (tmp_path / name).write_bytes(b"")
    memory.discard(tmp_path, RUN, before=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [n for n in names if "step00000003" not in n] + [half_written] + kept_apart)
    memory.discard(tmp_path, RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept_apart)
