"""DP x TP x PP (x ZeRO on the data-parallel axis) on one mesh in one run trains like one process."""

import functools

import pytest

from helpers import check_equivalent, config

_cfg = functools.partial(config, dp=2, tp=2, pp=2, microbatches=2)


def test_dp2_tp2_pp2_matches_single_process():
    check_equivalent([_cfg(zero=1, sequence_parallel=True, schedule="gpipe")], world_size=8, timeout=400)


@pytest.mark.slow
def test_dp2_tp2_pp2_with_every_zero_stage_and_schedule():
    check_equivalent([_cfg(), _cfg(zero=2, schedule="zb"), _cfg(zero=3), _cfg(model="tiny-deep", schedule="interleaved",
                                                                     virtual_stages=2)],
                     world_size=8, timeout=600)
