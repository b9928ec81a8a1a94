"""Restarting on the nodes that remain (``--elastic``) rescales the data-parallel axis only, or refuses in one
line; a multi-node ``trainmesh launch`` refuses node settings that cannot work before starting anything, and
a rank that fails on one node is named by node and rank on the others. ``launch --nnodes MIN:MAX`` hands
``train --elastic`` to torch's elastic agent with the c10d rendezvous, or refuses in one line first."""

import argparse
import os
import re

import pytest
import torch.distributed.launcher.api as torch_launcher
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from trainmesh.distributed import elastic
from trainmesh.app import cli
from trainmesh.app.cli import _launch
from trainmesh.distributed.launcher import Nodes, RankProcess, _failure_elsewhere, _post_failure, host_store
from trainmesh.app.config import ConfigError
from trainmesh.layout import Layout, LayoutError, flag, scaled_to_world


@pytest.mark.parametrize("layout, world, dp, replicas", [
    (Layout(dp=3), 2, 2, 1),
    (Layout(dp=2, tp=2, pp=2), 4, 1, 1),
    (Layout(dp=6, dp_replicate=3, zero=3), 4, 4, 2),  # groups of 2 dp ranks: one node lost, one replica less
])
def test_elastic_scales_dp_and_keeps_each_hybrid_group(layout, world, dp, replicas):
    scaled = scaled_to_world(layout, world, flag)
    assert (scaled.dp, scaled.dp_replicate, scaled.tp, scaled.pp) == (dp, replicas, layout.tp, layout.pp)


@pytest.mark.parametrize("layout, world, words", [
    (Layout(dp=2, tp=2), 3, "--elastic: 3 ranks are not a multiple of cp*tp*pp = 2"),
    (Layout(dp=4, dp_replicate=2, zero=3), 3, "groups of 2 ranks"),
])
def test_elastic_refuses_a_world_no_layout_fits(layout, world, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        scaled_to_world(layout, world, flag)


@pytest.mark.parametrize("nodes, words", [
    ({"nnodes": "2", "node_rank": "2", "master_port": "29500"}, "--node-rank 2 is not in"),
    ({"nnodes": "2", "node_rank": "1", "master_port": "0"}, "needs --master-port"),
    ({"nnodes": "two", "node_rank": "0", "master_port": "1"}, "--nnodes 'two' is not a whole number"),
])
def test_launch_refuses_node_settings_that_cannot_work(tmp_path, nodes, words):
    args = argparse.Namespace(nproc="1", stopped_grace="60", master_addr="127.0.0.1", script=str(tmp_path / "x.py"),
                              args=[], rdzv_endpoint=None, rdzv_id="trainmesh", rdzv_conf="", max_restarts=None,
                              **nodes)
    with pytest.raises(ConfigError, match=words):
        _launch(args, [])


def test_a_rank_failing_on_one_node_is_named_by_node_and_rank_on_the_others(capsys):
    """Node 1's launcher posts its killed rank 3 in the store node 0's launcher hosts; node 0 reads it, node 1
    does not report itself, and a rank that only lost a peer is not posted over it."""
    store, port = host_store()
    nodes = [Nodes(2, k, "127.0.0.1", port) for k in range(2)]
    assert _failure_elsewhere(store, nodes[0]) is None
    lost_peer = RankProcess(2, proc=None, node=1)
    lost_peer.tail.append("RuntimeError: Connection closed by peer\n")
    _post_failure(store, lost_peer, 1)
    assert _failure_elsewhere(store, nodes[0]) is None
    _post_failure(store, RankProcess(3, proc=None, node=1), -9)
    _post_failure(store, RankProcess(0, proc=None, node=0), -9)  # later: the first report stands
    assert _failure_elsewhere(store, nodes[0]) == "rank 3 on node 1 failed (killed by signal SIGKILL)"
    assert _failure_elsewhere(store, nodes[1]) is None


ELASTIC = ["launch", "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", "10.0.0.1:29500"]


@pytest.mark.parametrize("argv, words", [
    (["launch", "--nnodes", "3:2", "--rdzv-endpoint", "h:1", "train"], "--nnodes 3:2: MIN must be at least 1 and at most MAX"),
    (["launch", "--nnodes", "0:2", "--rdzv-endpoint", "h:1", "train"], "MIN must be at least 1"),
    (["launch", "--nnodes", "2:x", "--rdzv-endpoint", "h:1", "train"], "write the range as MIN:MAX"),
    (["launch", "--nnodes", "2:3", "train"], "--nnodes 2:3 needs --rdzv-endpoint HOST:PORT"),
    (["launch", "--nnodes", "2:3", "--rdzv-endpoint", "h", "train"], "--rdzv-endpoint 'h': give HOST:PORT"),
    ([*ELASTIC, "--node-rank", "1", "train"], "--node-rank is for a fixed node count"),
    ([*ELASTIC, "--master-addr", "h", "--master-port", "1", "train"], "--master-addr and --master-port are for"),
    ([*ELASTIC, "--rdzv-conf", "join_timeout", "train"], "--rdzv-conf 'join_timeout': write key=value pairs"),
    ([*ELASTIC, "--max-restarts", "-1", "train"], "--max-restarts '-1' is not a whole number"),
    ([*ELASTIC, "script.py"], "restarts `trainmesh train` on the nodes that remain, so it runs `train`, not 'script.py'"),
    (["launch", "--nnodes", "2", "--rdzv-endpoint", "h:1", "x.py"], "--rdzv-endpoint is for the elastic agent"),
    ([*ELASTIC, "train", "--dpp", "3"], "unrecognized arguments: --dpp"),
    ([*ELASTIC, "train", "--dp", "0", "--resume", "--checkpoint-dir", "ck"], "--dp 0"),
    ([*ELASTIC, "train", "--dp", "3"], "restarts `train` from its last checkpoint on the nodes that remain: give it "
                                       "--checkpoint-dir DIR and --resume"),
])
def test_an_elastic_launch_refuses_what_cannot_work_in_one_line_before_starting_anything(monkeypatch, capsys, argv,
                                                                                      words):
    monkeypatch.setattr(torch_launcher, "launch_agent", lambda *a, **k: pytest.fail("an agent was started"))
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's refusal of a train flag
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_an_elastic_launch_hands_train_elastic_to_torchs_agent_at_the_endpoint(monkeypatch):
    """The agent gets the node range, the c10d rendezvous at the endpoint under the job's id, the restarts and
    the rendezvous settings; every rank runs ``train --elastic`` with the user's flags; each round gets a
    store of its own."""
    started = {}

    def agent(config, entrypoint, args, **_):
        started.update(config=config, entrypoint=entrypoint, args=args, fresh=os.environ.get(elastic.FRESH_STORE_ENV))
        return {0: None}

    monkeypatch.setattr(torch_launcher, "launch_agent", agent)
    monkeypatch.delenv(elastic.FRESH_STORE_ENV, raising=False)
    argv = [*ELASTIC, "--rdzv-id", "job7", "--rdzv-conf", "join_timeout=60,last_call_timeout=5", "--max-restarts",
            "2", "--", "train", "--dp", "3", "--resume", "--checkpoint-dir", "ck"]
    assert cli.main(argv) == 0
    c = started["config"]
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.rdzv_backend, c.rdzv_endpoint, c.run_id, c.max_restarts) \
        == (2, 3, 1, "c10d", "10.0.0.1:29500", "job7", 2)
    assert c.rdzv_configs["join_timeout"] == "60" and c.rdzv_configs["last_call_timeout"] == "5"
    assert started["args"] == ["-u", "-m", "trainmesh", "train", "--elastic", "--dp", "3", "--resume", "--checkpoint-dir",
                               "ck"]
    assert started["fresh"] == "1"


def test_an_elastic_run_whose_ranks_fail_on_says_which_in_one_line(monkeypatch, capsys):
    def agent(config, *_, **__):
        raise ChildFailedError("trainmesh", {4: ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="")})

    monkeypatch.setattr(torch_launcher, "launch_agent", agent)
    monkeypatch.setenv(elastic.FRESH_STORE_ENV, "1")
    assert cli.main([*ELASTIC, "train", "--elastic", "--resume", "--checkpoint-dir", "ck"]) == 1
    waits, failed = capsys.readouterr().err.splitlines()
    assert waits.startswith("trainmesh launch: joining the rendezvous store at 10.0.0.1:29500 (--rdzv-id trainmesh); "
                            "waiting up to 600 s for at least 2 of 3 node(s) (join_timeout), then 30 s")
    assert failed == ("trainmesh: rank 4 failed (killed by SIGKILL) after 3 restart(s) of this node's ranks; its "
                      "traceback is above")


def test_an_elastic_run_that_lost_the_store_s_host_says_so_with_the_command_that_resumes(monkeypatch, capsys):
    """Another node's agent hosted the c10d store and is gone: one line, the single point of failure and the
    command, not the hint to check the endpoint and id (they were right)."""
    def agent(config, *_, **__):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(torch_launcher, "launch_agent", agent)
    monkeypatch.setenv(elastic.FRESH_STORE_ENV, "1")
    assert cli.main([*ELASTIC, "train", "--elastic", "--resume", "--checkpoint-dir", "ck"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("trainmesh: the rendezvous store at 10.0.0.1:29500 (--rdzv-id trainmesh) cannot be reached")
    assert "single point of failure" in last and last.endswith("--resume continues from the latest checkpoint in ck")
