"""Pure pieces, no processes: model presets, data sampling, LR schedule, byte accounting."""

import json
import math

import pytest
import torch

from trainmesh.distributed.comm import Comm
from trainmesh.data import DataError, TokenData, get_batch, global_batch_offsets
from trainmesh.distributed.mesh import Mesh
from trainmesh.tracking.records import METRICS_FILE, MetricsWriter
from trainmesh.models.gpt import GPT, PRESETS
from trainmesh.training.optim import LRSchedule


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_param_count_formula(name):
    cfg = PRESETS[name]
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.n_params()


def test_init_depends_on_seed_only():
    a, b, c = GPT(PRESETS["tiny"], seed=1), GPT(PRESETS["tiny"], seed=1), GPT(PRESETS["tiny"], seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.blocks["0"].attn.qkv.weight, c.blocks["0"].attn.qkv.weight)


def test_dp_slices_partition_the_global_batch():
    tokens = torch.arange(10_000) % 256
    full_x, full_y = get_batch(tokens, 16, 8, seed=3, step=5)
    parts = [get_batch(tokens, 16, 8, seed=3, step=5, dp_rank=r, dp_size=4) for r in range(4)]
    assert torch.equal(torch.cat([x for x, _ in parts]), full_x)
    assert torch.equal(full_y[:, :-1], full_x[:, 1:])
    assert not torch.equal(global_batch_offsets(10_000, 16, 8, 3, 5), global_batch_offsets(10_000, 16, 8, 3, 6))


def test_default_corpus_is_real_text():
    data = TokenData.load("", seq_len=32)
    assert len(data.train) > 1_000_000
    assert b"def " in bytes(data.train[:100_000].tolist())


def test_short_file_is_rejected(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("hello")
    with pytest.raises(DataError, match="needs at least"):
        TokenData.load(str(f), seq_len=32)


def test_lr_warmup_then_cosine():
    schedule = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=10, steps=100)
    assert schedule.at(0) == pytest.approx(0.1)
    assert schedule.at(9) == pytest.approx(1.0)
    assert schedule.at(10) == pytest.approx(1.0)
    assert schedule.at(55) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert schedule.at(100) == pytest.approx(0.1)


def test_collectives_on_a_size_one_axis_are_free():
    comm = Comm(Mesh.build(1, 1, 1, torch.device("cpu")))
    t = torch.ones(10)
    comm.all_reduce(t, "dp").wait()
    out = torch.empty(10)
    comm.all_gather(out, t, "dp")
    assert torch.equal(out, t) and comm.totals() == {}


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_resumed_metrics_file_keeps_one_record_per_step_and_marks_the_restart(tmp_path):
    crashed = MetricsWriter(str(tmp_path), enabled=True)
    for step in range(1, 7):
        crashed.write({"step": step, "loss": 1.0})
    crashed.close()
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 7, "lo')  # a write the kill cut short
    resumed = MetricsWriter(str(tmp_path), enabled=True, resume_from=3)  # from the checkpoint of step 3
    for step in (4, 5):
        resumed.write({"step": step, "loss": 2.0})
    resumed.close()
    records = _records(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [1.0, 1.0, 1.0, 2.0, 2.0]
    assert [r.get("restart") for r in records] == [None, None, None, {"from_step": 3, "replayed_steps": 3}, None]


def test_a_new_run_starts_a_new_metrics_file(tmp_path):
    for loss in (1.0, 2.0):
        writer = MetricsWriter(str(tmp_path), enabled=True)
        writer.write({"step": 0, "loss": loss})
        writer.close()
    assert _records(tmp_path / METRICS_FILE) == [{"step": 0, "loss": 2.0}]
