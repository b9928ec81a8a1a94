"""Tokenizers, ``trainmesh prepare`` and memory-mapped token shards: formats, sampling across layouts and
resumes, the held-out split, and every kind of bad input as one line before training starts."""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainmesh import checkpoint
from trainmesh.app import checkpoints
from trainmesh.app import cli
from trainmesh.app.config import Config
from trainmesh.data import DataError, TokenData, get_batch
from trainmesh.data.prepare import PrepareOptions, prepare
from trainmesh.data.shards import INDEX_FILE, read_index
from trainmesh.data.text import stdlib_sources
from trainmesh.app.generate import Sampling, generate_text
from trainmesh.data.tokenizer import TokenizerError, load_tokenizer, padded_vocab

pytest.importorskip("tokenizers")

DOCS = [f"def f{i}(x):\n    return x * {i}  # document {i} " + "é" * (i % 3) + "\n" * (i % 2) for i in range(60)]


def make_prepared(tmp: Path, tok: str, docs: list[str] = DOCS, workers: int = 2, shard_tokens: int = 400) -> str:
    src = tmp / "docs"
    src.mkdir(exist_ok=True)
    for i, d in enumerate(docs):
        (src / f"{i:03d}.txt").write_text(d, encoding="utf-8")
    out = tmp / f"data-{workers}"
    prepare(PrepareOptions((str(src),), tok, str(out), workers, shard_tokens, val_fraction=0.1),
            stream=open(os.devnull, "w"))
    return str(out)


def shard_tokens(root: str, split: str) -> list[int]:
    index = read_index(root)
    return [int(t) for s in index.split(split) for t in np.fromfile(Path(root, s.file), dtype=index.dtype)]


def test_tokenizer_round_trip_and_padded_vocabulary(tok):
    t = load_tokenizer(tok)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcode\n"
    assert t.decode(t.encode(text)) == text
    assert t.vocab_size == 300 and t.eos_id is not None and len(t.encode(text)) < len(text.encode())
    b = load_tokenizer("")
    assert b.vocab_size == 256 and b.decode(b.encode(text)) == text
    assert (padded_vocab(300, 1), padded_vocab(300, 2), padded_vocab(256, 4)) == (320, 384, 256)
    assert Config.from_settings(tokenizer=tok).model_config.vocab_size == 320
    assert Config.from_settings(tokenizer=tok, tp=2).model_config.vocab_size == 384
    assert Config().model_config.vocab_size == 256  # bytes: the preset's vocabulary


def test_prepare_writes_documents_with_eos_and_a_document_split(tmp_path, tok):
    root = make_prepared(tmp_path, tok)
    index, t = read_index(root), load_tokenizer(tok)
    raw = json.loads(Path(root, INDEX_FILE).read_text())
    assert index.dtype == np.uint16 and raw["tokenizer"] == {"path": "tokenizer.json",
                                                             "sha256": hashlib.sha256(Path(tok).read_bytes()).hexdigest()}
    assert Path(root, "tokenizer.json").read_bytes() == Path(tok).read_bytes()  # the data keeps its tokenizer
    assert len(index.split("train")) > 1  # shard_tokens=400 cuts several shards, at document ends
    val_docs = [d for k, d in enumerate(DOCS) if k % 10 == 0]  # val_fraction 0.1: documents 0, 10, 20, ...
    train_docs = [d for k, d in enumerate(DOCS) if k % 10]
    assert raw["documents"] == {"train": len(train_docs), "val": len(val_docs)}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        assert shard_tokens(root, split) == [i for d in docs for i in (*t.encode(d), t.eos_id)]
    one_worker = make_prepared(tmp_path, tok, workers=1)
    assert [s.sha256 for s in read_index(one_worker).shards] == [s.sha256 for s in index.shards]


def test_prepare_reads_jsonl_parquet_and_a_saved_hf_dataset(tmp_path, tok):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    docs = DOCS[:12]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    pq.write_table(pa.table({"text": docs}), tmp_path / "b.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    inputs = (str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), str(tmp_path / "hf"))
    prepare(PrepareOptions(inputs, tok, str(tmp_path / "out"), 2, 1 << 20, 0.25), stream=open(os.devnull, "w"))
    t, all_docs = load_tokenizer(tok), docs * 3
    expect = [i for k, d in enumerate(all_docs) if k % 4 for i in (*t.encode(d), t.eos_id)]
    assert shard_tokens(str(tmp_path / "out"), "train") == expect
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"c.jsonl:2: not a JSON object with a string 'text' field"):
        prepare(PrepareOptions((str(tmp_path / "c.jsonl"),), tok, str(tmp_path / "out2"), 1), stream=sys.stderr)


def test_sampling_is_the_same_at_dp4_dp2_and_after_a_resume(tmp_path, tok):
    """The token ids each rank trains on at dp 4 and at dp 2 (and after reopening the data, as a resumed
    run does) concatenate to the single-process global batch of every step."""
    root = make_prepared(tmp_path, tok)
    data = TokenData.load(root, seq_len=16, verify=True)
    assert len(data.train) > 1000 and len(data.val) > 17
    for step in range(5):
        x1, y1 = get_batch(data.train, 16, 8, seed=7, step=step)
        for dp in (4, 2):
            parts = [get_batch(data.train, 16, 8, seed=7, step=step, dp_rank=r, dp_size=dp) for r in range(dp)]
            assert torch.equal(torch.cat([x for x, _ in parts]), x1) and torch.equal(torch.cat([y for _, y in parts]), y1)
        resumed = TokenData.load(root, seq_len=16)
        assert torch.equal(get_batch(resumed.train, 16, 8, seed=7, step=step, dp_rank=1, dp_size=2)[0], x1[4:])
    assert int(x1.max()) < 300  # ids never reach the pad rows


def test_window_across_shards_is_the_concatenation(tmp_path, tok):
    root = make_prepared(tmp_path, tok)
    stream, flat = TokenData.load(root, seq_len=16).train, shard_tokens(root, "train")
    boundary = read_index(root).split("train")[0].tokens
    assert stream[boundary - 5:boundary + 7].tolist() == flat[boundary - 5:boundary + 7]


def _train_error(capsys, *argv: str) -> str:
    assert cli.main(["train", "--steps", "1", "--out", "", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"train-00000.bin is truncated: 98 bytes, index.json lists 50 uint16 tokens \(100 bytes\)"),
    ("flip", r"train-00000.bin: SHA-256 does not match index.json"),
    ("big_id", r"train-00000.bin: token id 4000 at position 3 is outside the vocabulary of 300"),
    ("empty", r"train-00000.bin is an empty shard"),
])
def test_damaged_shards_are_one_line_before_training(tmp_path, tok, capsys, damage, message):
    root = make_prepared(tmp_path, tok, shard_tokens=1 << 20)
    index_path, shard = Path(root, INDEX_FILE), Path(root, "train-00000.bin")
    ids = np.fromfile(shard, dtype=np.uint16)[:50]
    ids.tofile(shard)
    raw = json.loads(index_path.read_text())
    raw["shards"][0]["tokens"] = 50
    raw["shards"][0]["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    if damage == "truncate":
        shard.write_bytes(ids.tobytes()[:-2])
    elif damage == "flip":
        ids[7] = (ids[7] + 1) % 300
        ids.tofile(shard)
    elif damage == "big_id":
        ids[3] = 4000
        ids.tofile(shard)
        raw["shards"][0]["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    else:
        shard.write_bytes(b"")
        raw["shards"][0]["tokens"] = 0
    raw["shards"][0]["documents"] = min(raw["shards"][0]["documents"], raw["shards"][0]["tokens"])
    for total in ("tokens", "documents"):  # the index stays consistent: only the shard is damaged
        raw[total] = {split: sum(s[total] for s in raw["shards"] if s["split"] == split) for split in raw[total]}
    index_path.write_text(json.dumps(raw))
    assert re.search(message, _train_error(capsys, "--data", root))


def test_wrong_tokenizer_and_token_files_are_refused(tmp_path, tok, capsys):
    root = make_prepared(tmp_path, tok)
    other = tmp_path / "other.json"
    other.write_text(Path(tok).read_text().replace('"<|endoftext|>"', '"<|end|>"'))
    assert "is not the one" in _train_error(capsys, "--data", root, "--tokenizer", str(other))
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "tokens.bin")  # valid UTF-8, but a token file
    np.save(tmp_path / "tokens.npy", np.arange(100, dtype=np.uint16))
    for name in ("tokens.bin", "tokens.npy"):
        err = _train_error(capsys, "--data", str(tmp_path / name))
        assert "binary token file" in err and "trainmesh prepare" in err and "convert it to UTF-8" not in err
    manifest = {"model": {**vars(Config().model_config), "vocab_size": 320}, "config": {"model": "tiny",
                                                                                        "tokenizer": tok}}
    with pytest.raises(checkpoint.CheckpointMismatch, match="vocabulary 320.*gives 256.*--tokenizer"):
        checkpoints._check_model(manifest, Config(), tmp_path)


def test_the_readme_walk_through_tokenizer_prepare_train_report_generate(tmp_path, capfd):
    """The README's walk-through at small size, command by command: tokenizer train -> prepare -> train
    --data (two steps, checkpointed) -> report -> generate, which decodes with the tokenizer the data was
    prepared with (the checkpoint records it)."""
    docs = tmp_path / "corpus"
    docs.mkdir()
    for f in stdlib_sources()[:40]:
        (docs / f.name).write_bytes(f.read_bytes())
    tok = str(tmp_path / "tok.json")
    assert cli.main(["tokenizer", "train", "--input", str(docs), "--vocab-size", "320", "--out", tok]) == 0
    assert cli.main(["prepare", "--input", str(docs), "--tokenizer", tok, "--out", str(tmp_path / "data"),
                     "--workers", "2"]) == 0
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    assert cli.main(["train", "--data", str(tmp_path / "data"), "--steps", "2", "--global-batch", "4",
                     "--out", str(out), "--checkpoint-dir", str(ckpt), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["tokenizer"] == "" and summary["val_perplexity"] == pytest.approx(
        np.exp(summary["val_loss"]))
    assert "prepared" in capfd.readouterr().err
    assert cli.main(["report", str(out)]) == 0
    assert (out / "report.png").stat().st_size > 0
    capfd.readouterr()
    assert cli.main(["generate", "--checkpoint-dir", str(ckpt), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    text = capfd.readouterr().out
    assert text.startswith("def ") and len(text) > len("def ")
    other = str(tmp_path / "other.json")
    assert cli.main(["tokenizer", "train", "--input", str(docs), "--vocab-size", "300", "--out", other]) == 0
    with pytest.raises(TokenizerError, match="SHA-256"):  # it recorded the prepared data's file, not bytes
        generate_text(str(ckpt), "def ", 4, Sampling(0.0, 0, 1.0, 0), None, other, "cpu")


def test_core_imports_and_loads_bytes_without_the_data_extra():
    blocked = "import sys; [sys.modules.__setitem__(m, None) for m in ('tokenizers', 'pyarrow', 'datasets', 'tqdm')]"
    code = (f"{blocked}; import trainmesh.app.cli, trainmesh.app.train; from trainmesh.data import TokenData; "
            "d = TokenData.load('', 32); assert d.train.dtype.itemsize == 1; "
            "from trainmesh.data.tokenizer import load_tokenizer, TokenizerError\n"
            "try:\n    load_tokenizer(sys.argv[1])\nexcept TokenizerError as e:\n    print(e)")
    marker = Path(__file__)
    done = subprocess.run([sys.executable, "-c", code, str(marker)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert "needs the 'tokenizers' package" in done.stdout
