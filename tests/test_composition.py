"""DP x TP x PP (x ZeRO on the data-parallel axis) on one mesh in one run trains like one process."""

import pytest

from trainmesh.app.config import Config

from helpers import check_equivalent

def _cfg(**kw) -> Config:
    base = {"nproc": 8, "dp": 2, "tp": 2, "pp": 2, "steps": 10, "global_batch": 8, "microbatches": 2,
            "progress": False, "warmup_steps": 2}
    return Config(**{**base, **kw})


def test_dp2_tp2_pp2_matches_single_process():
    check_equivalent([_cfg(zero=1, sequence_parallel=True, schedule="gpipe")], world_size=8, timeout=400)


@pytest.mark.slow
def test_dp2_tp2_pp2_with_every_zero_stage_and_schedule():
    check_equivalent([_cfg(), _cfg(zero=2, schedule="zb"), _cfg(zero=3), _cfg(model="tiny-deep", schedule="interleaved",
                                                                     virtual_stages=2)],
                     world_size=8, timeout=600)
