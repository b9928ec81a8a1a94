"""The command line refuses a layout setting that cannot run, naming the flag and the fix."""

import dataclasses

import pytest

from trainmesh.app import config
from trainmesh.app.config import Config, ConfigError, validate
from trainmesh.models import spec_of

BAD = [
    (dict(pp=2, virtual_stages=2), "needs --schedule interleaved"),
    (dict(pp=2, schedule="interleaved", microbatches=2), "set --virtual-stages >= 2"),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=3, global_batch=6), "multiple of 2"),
    (dict(pp=2, schedule="interleaved", virtual_stages=2, microbatches=2), "stages exceed the 2 layers"),
    (dict(pp=2, model="tiny-deep", stage_layers=(3, 4)), "summing to the 8 layers"),
    (dict(pp=1, virtual_stages=2), "--virtual-stages is a pipeline setting"),
    (dict(pp=1, timeline="t.png"), "--timeline is a pipeline setting"),
    (dict(pp=2, schedule="zb", compile=True), "drop --compile"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m for _, m in BAD])
def test_bad_pipeline_config_is_rejected_with_the_fix(kw, message):
    cfg = Config.from_settings(**{"nproc": kw.get("pp", 1), **kw})
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_a_family_without_a_cp_plan_is_refused(monkeypatch):
    spec = dataclasses.replace(spec_of("tiny"), cp_plan={})
    monkeypatch.setattr(config, "spec_of", lambda _name: spec)
    with pytest.raises(ConfigError, match="names no attention core context parallelism can split"):
        validate(Config.from_settings(nproc=2, cp=2))


def test_tp_beyond_the_kv_heads_is_refused_with_the_valid_choices():
    with pytest.raises(ConfigError, match=r"^--tp 4 exceeds n_kv_heads=2 of llama-tiny .*; choose tp in \{1, 2\}$"):
        validate(Config.from_settings(model="llama-tiny", nproc=4, tp=4))
    validate(Config.from_settings(model="llama-tiny", nproc=2, tp=2))
    assert spec_of("llama-tiny").family == "llama" and spec_of("tiny").family == "gpt"
