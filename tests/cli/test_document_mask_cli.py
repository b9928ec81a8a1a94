"""``trainmesh train --document-mask`` on prepared data: two steps at cp2 (ring, shards balanced by attention work),
the documents recovered from the end-of-document token ``prepare`` writes; the loss differs from the same run without
the mask (attention no longer crosses documents)."""

import argparse
import json

import pytest
import torch

from trainmesh.app import cli
from trainmesh.app.planning import add_plan_arguments, plan_config, plan_from_args, workload_of
from trainmesh.data import DataError, document_lengths
from trainmesh.data.shards import ShardStream, read_index

from runs import config
from test_data import make_prepared

SHORT_DOCS = [f"x = {i}\n" * (1 + i % 4) for i in range(200)]  # documents of 6 to 24 bytes: several a window


def _train(tmp_path, data: str, name: str, *flags: str) -> float:
    out = tmp_path / name
    assert cli.main(["train", "--data", data, "--model", "llama-tiny", "--nproc", "2", "--cp", "2", "--steps", "2",
                     "--global-batch", "2", "--seq-len", "32", "--precision", "fp64", "--out", str(out), "--no-progress",
                     "--no-tensorboard", *flags]) == 0
    return json.loads((out / "summary.json").read_text())["val_loss"]


def test_train_document_mask_runs_at_cp2_and_changes_the_loss(tmp_path, tok):
    data = make_prepared(tmp_path, tok, docs=SHORT_DOCS, shard_tokens=1 << 20)
    masked = _train(tmp_path, data, "masked", "--document-mask")
    plain = _train(tmp_path, data, "plain")
    assert abs(masked - plain) > 1e-6


def _plan(*flags: str) -> str:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return plan_from_args(parser.parse_args(["--model", "mistral-7b", "--gpus", "8", "--gpu", "h100-80gb", *flags]))


def test_plan_prices_the_document_mix_of_prepared_data_and_says_what_the_mask_saves(tmp_path, tok):
    data = make_prepared(tmp_path, tok, docs=SHORT_DOCS, shard_tokens=1 << 20)
    train = ShardStream(read_index(data), read_index(data).split("train"))
    lengths = document_lengths(train, read_index(data).eos_id)
    assert sum(lengths) <= len(train) and min(lengths) >= 2  # each document's text and its end
    assert len(lengths) == int((torch.as_tensor(train[0:len(train)]) == read_index(data).eos_id).sum())
    measured = _plan("--documents", data).splitlines()[-1]
    given = _plan("--documents", ",".join(map(str, lengths))).splitlines()[-1]
    assert measured == given and measured.startswith("The document mask saves ")
    assert "The document mask" not in _plan()  # no documents, no claim
    run = config(model="llama-tiny", data=data, document_mask=True, dp=2, seq_len=32)
    assert "the document mask saves" in plan_config(run, 2)[1] and workload_of(run).documents == lengths
    longer = float(_plan("--documents", "4096").splitlines()[-1].split("saves ")[1].split("%")[0])
    assert longer < float(measured.split("saves ")[1].split("%")[0])  # one whole-window document saves least


@pytest.mark.parametrize("flag, message", [("0,5", "at least 1 token"), ("nowhere", "not prepared data")])
def test_plan_refuses_documents_it_cannot_read_in_one_line(flag, message):
    with pytest.raises((ValueError, DataError), match=message):
        _plan("--documents", flag)
