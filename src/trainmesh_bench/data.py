"""The data path measured (``make bench-data``): ``prepare`` throughput, the loader against what training
consumes, and a trainer's memory against corpus size. It prints figures and asserts nothing.

Everything generated goes under ``--workdir`` (default: a new directory in /tmp), removed at the end.
Method: docs/performance.md."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trainmesh.data import TokenData, get_batch
from trainmesh.data.prepare import PrepareOptions, prepare
from trainmesh.data.shards import INDEX_FILE, Index, Shard, token_dtype
from trainmesh.data.text import text_documents
from trainmesh.models import preset
from trainmesh.data.tokenizer import TOKENIZER_FILE, TokenizerFile, train_bpe

MB = 10**6
GB = 10**9


def write_corpus(path: Path, megabytes: float) -> int:
    """The first ``megabytes`` of the default corpus as JSONL, one document per file; returns bytes written."""
    budget, written = int(megabytes * MB), 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in text_documents(""):
            text = doc.decode("utf-8", errors="ignore")
            f.write(json.dumps({"text": text}) + "\n")
            written += len(doc)
            if written >= budget:
                break
    return written


def bench_prepare(work: Path, corpus: Path, tok: str) -> dict[int, float]:
    """Tokens/s of ``prepare`` with 1 and 2 workers on ``corpus``."""
    rates = {}
    with open(os.devnull, "w") as quiet:
        for workers in (1, 2):
            out = work / f"prepared-{workers}"
            t0 = time.perf_counter()
            index = prepare(PrepareOptions((str(corpus),), tok, str(out), workers), stream=quiet)
            rates[workers] = sum(s.tokens for s in index.shards) / (time.perf_counter() - t0)
    return rates


def synthetic_tokens(root: Path, gigabytes: float, vocab: int, tok: str, shard_tokens: int = 1 << 27) -> None:
    """A prepared directory of ``gigabytes`` of random ids below ``vocab`` (5% held out)."""
    dtype = token_dtype(vocab)
    total = int(gigabytes * GB) // dtype.itemsize
    root.mkdir(parents=True)
    rng, shards = np.random.default_rng(0), []
    for split, n in (("train", total - total // 20), ("val", total // 20)):
        for k, start in enumerate(range(0, n, shard_tokens)):
            count, digest = min(shard_tokens, n - start), hashlib.sha256()
            name = f"{split}-{k:05d}.bin"
            with open(root / name, "wb") as f:
                for off in range(0, count, 1 << 24):
                    ids = rng.integers(0, vocab, min(1 << 24, count - off), dtype=dtype)
                    f.write(ids.tobytes())
                    digest.update(ids.tobytes())
            shards.append(Shard(name, split, count, 1, digest.hexdigest()))
    pinned = TokenizerFile.read(tok)
    (root / TOKENIZER_FILE).write_bytes(pinned.data)
    index = Index(root, dtype, vocab, 0, pinned.sha256, TOKENIZER_FILE, tuple(shards))
    (root / INDEX_FILE).write_text(json.dumps(index.to_json()))


def bench_loader(data: str, steps: int) -> float:
    """Tokens/s of the sampler on ``small``'s shape (global batch 16)."""
    seq_len, batch = preset("small").seq_len, 16
    tokens = TokenData.load(data, seq_len).train
    t0 = time.perf_counter()
    for step in range(steps):
        get_batch(tokens, seq_len, batch, seed=0, step=step)
    return steps * batch * seq_len / (time.perf_counter() - t0)


def train_summary(data: str, out: Path, steps: int) -> tuple[dict, float]:
    """``trainmesh train --model small`` on ``data`` in its own process: its summary and wall seconds."""
    cmd = [sys.executable, "-m", "trainmesh", "train", "--model", "small", "--global-batch", "16",
           "--steps", str(steps), "--out", str(out), "--no-progress", "--data", data]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text()), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare-mb", type=float, default=8.0, help="text for the prepare benchmark (MB)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary trained for the benchmark")
    parser.add_argument("--small-gb", type=float, default=0.1, help="the small corpus of tokens (GB)")
    parser.add_argument("--large-gb", type=float, default=1.0, help="the large corpus of tokens (GB; 4 in the issue)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per RSS run")
    parser.add_argument("--loader-steps", type=int, default=2000, help="sampler steps timed")
    parser.add_argument("--workdir", default="", help="where generated data goes (default: a new /tmp directory)")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trainmesh-bench-data-"))
    try:
        corpus = work / "corpus.jsonl"
        text_bytes = write_corpus(corpus, args.prepare_mb)
        tok = str(work / "tok.json")
        t0 = time.perf_counter()
        train_bpe((json.loads(line)["text"] for line in open(corpus, encoding="utf-8")), args.vocab_size, Path(tok))
        print(f"bench data: BPE of {args.vocab_size} tokens trained on {text_bytes / MB:.1f} MB in "
              f"{time.perf_counter() - t0:.1f} s ({os.cpu_count()} CPU cores)")
        for workers, rate in bench_prepare(work, corpus, tok).items():
            print(f"prepare, {workers} worker(s): {rate:,.0f} tokens/s")
        rss = {}
        for gb in (args.small_gb, args.large_gb):
            data = work / f"tokens-{gb:g}GB"
            synthetic_tokens(data, gb, args.vocab_size, tok)
            summary, seconds = train_summary(str(data), work / f"run-{gb:g}", args.steps)
            rss[gb] = max(summary["max_rss_bytes"])
            print(f"train --data {gb:g} GB of tokens: peak RSS {rss[gb] / 2**20:,.0f} MiB, "
                  f"{summary['tokens_per_s']:,.0f} tokens/s ({seconds:.1f} s with the shard checks)")
        loader = bench_loader(str(work / f"tokens-{args.large_gb:g}GB"), args.loader_steps)
        print(f"loader: {loader:,.0f} tokens/s = {loader / summary['tokens_per_s']:,.0f}x what small training "
              f"consumes here (target >= 100x)")
        print(f"RSS difference, {args.large_gb:g} GB vs {args.small_gb:g} GB of tokens: "
              f"{(rss[args.large_gb] - rss[args.small_gb]) / 2**20:+,.1f} MiB (target < 50 MB)")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
