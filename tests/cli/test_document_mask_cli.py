"""``trainmesh train --document-mask`` on prepared data: two steps at cp2 (ring, shards balanced by attention work),
the documents recovered from the end-of-document token ``prepare`` writes; the loss differs from the same run without
the mask (attention no longer crosses documents)."""

import json

from trainmesh.app import cli

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
