"""Restarting on the nodes that remain (``--elastic``) rescales the data-parallel axis only, or refuses in one
line; a multi-node ``trainmesh launch`` refuses node settings that cannot work before starting anything, and
a rank that fails on one node is named by node and rank on the others."""

import argparse
import re

import pytest

from trainmesh.app.cli import _launch
from trainmesh.launcher import Nodes, RankProcess, _failure_elsewhere, _post_failure, host_store
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
                              args=[], **nodes)
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
