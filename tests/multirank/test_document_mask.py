"""A packed, document-masked batch (documents ending at each newline of the default corpus, so a window holds several
of unequal lengths) trains at dp2, tp2 + sp, pp2 (1F1B and interleaved), cp2 ring and all-to-all (shards balanced by
attention work) and ep2 as one process does (float64, 1e-9); the single process equals the documents run alone
(tests/unit/test_packed_documents.py). The larger layouts run in the slow set."""

import functools

import pytest

from helpers import check_equivalent
from helpers import config as run_config

NEWLINE = 10
_cfg = functools.partial(run_config, steps=3, global_batch=4, warmup_steps=1, document_eos=NEWLINE)


def test_packed_documents_at_dp2_tp2_sp_cp2_ring_and_a2a_and_ep2_match_single_process():
    """cp2 ring with rotary (llama) and learned (GPT) positions, a2a with Mistral's window inside documents."""
    check_equivalent([_cfg(model="llama-tiny", dp=2), _cfg(model="qwen3-tiny", tp=2, sequence_parallel=True),
                      _cfg(model="llama-tiny", cp=2), _cfg(cp=2), _cfg(model="mistral-tiny", cp=2, cp_impl="a2a"),
                      _cfg(model="qwen3-moe-tiny", dp=2, ep=2)], world_size=2, timeout=600)


def test_packed_documents_at_pp2_1f1b_and_interleaved_with_learned_positions_match_single_process():
    check_equivalent([_cfg(pp=2, microbatches=2), _cfg(model="tiny-deep", pp=2, schedule="interleaved",
                                                       virtual_stages=2, microbatches=2)], world_size=2, timeout=600)


@pytest.mark.slow
def test_packed_documents_in_every_family_and_more_layouts_match_single_process():
    check_equivalent([_cfg(model="mistral-tiny", cp=2), _cfg(model="gemma3-tiny", cp=2),
                      _cfg(model="deepseek-v3-tiny", cp=2), _cfg(cp=2, cp_impl="a2a", microbatches=2),
                      _cfg(model="gpt-oss-tiny", tp=2, sequence_parallel=True), _cfg(model="gpt-oss-tiny", cp=2),
                      _cfg(model="gemma3-tiny", pp=2, microbatches=2, recompute="full"),
                      _cfg(model="llama-tiny", dp=2, zero=3, recompute="selective"),
                      _cfg(model="deepseek-v3-tiny", dp=2, ep=2), _cfg(model="llama-tiny", pp=2, schedule="zb",
                                                                         microbatches=2)],
                     world_size=2, timeout=900)


@pytest.mark.slow
def test_packed_documents_at_cp4_and_cp2_tp2_sp_pp2_match_single_process():
    check_equivalent([_cfg(model="llama-tiny", cp=4), _cfg(model="llama-tiny", cp=2, tp=2, sequence_parallel=True),
                      _cfg(model="llama-tiny", cp=2, pp=2, microbatches=2)], world_size=4, timeout=900)
