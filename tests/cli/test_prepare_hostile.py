"""Hostile and careless input to ``trainmesh prepare`` and to the data index ``train`` reads.

A document of any length is tokenized in pieces (peak RSS measured, not assumed); a worker killed mid-run
ends the command at once in one line and leaves nothing that looks prepared; a lone surrogate or a text
column of the wrong type is one line; an index that ``prepare`` would not write is one line. The fuzzer
mutates a real prepared directory's ``index.json`` and shard files 1,200 times and loads each with the
loader ``train`` uses, which must load correct data or refuse in one line, never raise anything else or hang.
"""

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fuzz import CaseTimeout, deadline, json_nodes
from helpers import child_pids
from trainmesh.app import cli
from trainmesh.data import DataError, TokenData, data_vocab_size, sources
from trainmesh.data import prepare as prepare_module
from trainmesh.data.prepare import PrepareOptions, prepare
from trainmesh.data.shards import INDEX_FILE, is_prepared, read_index, token_dtype
from trainmesh.data.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")

SMALL_PIECE = 8 << 10
TOKENIZER_BYTES_PER_CHAR = 1024
"""A generous upper estimate of what HF tokenizers hold per character while encoding (~250-350 measured)."""


def _code(n: int) -> str:
    src = Path(json.__file__).read_text(encoding="utf-8") + "# héllo wörld 😀\n"
    return (src * (n // len(src) + 1))[:n]


def _quiet(opts: PrepareOptions) -> None:
    with open(os.devnull, "w") as null:
        prepare(opts, stream=null)


def _decoded(root: Path, tok: str) -> str:
    t, index = load_tokenizer(tok), read_index(str(root))
    ids = [i for s in index.shards for i in np.fromfile(root / s.file, dtype=index.dtype).tolist()]
    assert ids[-1] == t.eos_id and t.eos_id not in ids[:-1]
    return t.decode(ids[:-1])


def _prepare_error(capsys, *argv: str) -> str:
    assert cli.main(["prepare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


# --- memory: any document in pieces ---------------------------------------------------------------------

def _peak_rss(opts: PrepareOptions) -> int:
    """Peak RSS in bytes of ``prepare`` run in a forked child, its workers included: ``os.wait4`` gives that
    child's own rusage (``RUSAGE_CHILDREN`` of a process whose only child it is), unpolluted by the children
    this test process ran before."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            _quiet(opts)
            code = 0
        finally:
            os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return usage.ru_maxrss * 1024


def test_a_long_jsonl_line_and_a_long_parquet_cell_stay_within_the_piece_bound(tmp_path, tok, monkeypatch):
    """Pieces and batches of 8 KiB, a tokenizer takes at most 1 KiB per character it encodes at once, and
    a batch holds at most BATCH_BYTES + 2·PIECE_BYTES characters (one piece is at most two reads): so
    prepare's peak may exceed its baseline on a tiny file by at most 24 MiB. A 256 KiB JSONL line (32
    pieces; tokenized whole it takes ~65 MiB more) and a 256 KiB Parquet cell (which Arrow holds, a few
    times over while decoding it) stay within that; each decodes back to its text."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(sources, "PIECE_BYTES", SMALL_PIECE)
    monkeypatch.setattr(prepare_module, "BATCH_BYTES", SMALL_PIECE)
    text = _code(256 << 10)
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "x = 1\n"}) + "\n")
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": 7, "text": text}) + "\n")
    pq.write_table(pa.table({"text": [text]}), tmp_path / "long.parquet")
    peaks = {name: _peak_rss(PrepareOptions((str(tmp_path / name),), tok, str(tmp_path / f"out-{name}"), 1))
             for name in ("tiny.jsonl", "long.jsonl", "long.parquet")}
    bound = peaks["tiny.jsonl"] + TOKENIZER_BYTES_PER_CHAR * 3 * SMALL_PIECE
    cell = len(text.encode())
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}, f"bound {bound / 2**20:.0f} MiB")
    assert peaks["long.jsonl"] < bound, peaks
    assert peaks["long.parquet"] < bound + 4 * cell, peaks
    for name in ("long.jsonl", "long.parquet"):
        assert _decoded(tmp_path / f"out-{name}", tok) == text


def test_a_long_hf_dataset_row_is_tokenized_in_pieces(tmp_path, tok, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(sources, "PIECE_BYTES", SMALL_PIECE)
    text = _code(10 * SMALL_PIECE)
    datasets.Dataset.from_dict({"text": [text]}).save_to_disk(str(tmp_path / "hf"))
    got = list(sources.pieces(tmp_path / "hf"))
    assert len(got) > 5 and max(len(p.text) for p in got) <= 2 * SMALL_PIECE
    _quiet(PrepareOptions((str(tmp_path / "hf"),), tok, str(tmp_path / "out"), 1))
    assert _decoded(tmp_path / "out", tok) == text


def test_arrow_cells_are_read_in_place_across_batches_nulls_and_large_strings(tmp_path, monkeypatch):
    """Cells are viewed in the column's buffers: batches of 2 rows slice the table (arrays with an offset),
    a null is an empty document, and large_string (64-bit offsets) reads as string does."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(sources, "ARROW_BATCH_ROWS", 2)
    monkeypatch.setattr(sources, "PIECE_BYTES", 64)
    docs = ["first", None, "é" * 100 + "\n" + "x" * 70, "", "😀 last"]
    pq.write_table(pa.table({"text": pa.array(docs, pa.large_string())}), tmp_path / "large.parquet")
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    for name in ("large.parquet", "hf"):
        texts, doc = [""], []
        for p in sources.pieces(tmp_path / name):
            texts[-1] += p.text
            if p.ends_document:
                doc.append(texts[-1])
                texts.append("")
        assert doc == [d or "" for d in docs], name


# --- a worker that dies ---------------------------------------------------------------------------------

def _kill_first_worker(before: set[int], out: Path, killed: list) -> None:
    """Once a shard exists (the run is under way), SIGKILL the first worker: a real kill -9 from outside."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = sorted(child_pids() - before)
        if workers and any(out.glob("*.bin")):
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])
            return
        time.sleep(0.005)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through /proc")
def test_a_worker_killed_mid_run_ends_prepare_at_once_in_one_line(tmp_path, tok, capsys, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_BYTES", SMALL_PIECE)
    monkeypatch.setattr(prepare_module, "BATCH_BYTES", SMALL_PIECE)
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(_code(1 << 20))
    out, killed, before = tmp_path / "out", [], child_pids()  # earlier tests may have left a forkserver
    killer = threading.Thread(target=_kill_first_worker, args=(before, out, killed))
    killer.start()
    start = time.monotonic()
    err = _prepare_error(capsys, "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--tokenizer", tok,
                         "--out", str(out), "--workers", "2")
    seconds = time.monotonic() - start
    killer.join()
    assert killed, "prepare finished before a worker could be killed"
    assert re.fullmatch(rf"trainmesh: error: worker [01] \(pid {killed[0]}\) was killed by signal SIGKILL \(out of "
                        rf"memory\?\) while tokenizing {tmp_path}/[ab]\.txt; nothing was kept in {out}", err), err
    assert seconds < 30 and not out.exists() and not is_prepared(str(out))
    assert not child_pids() - before, "workers left running"


def test_workers_tokenize_with_the_bytes_prepare_pinned_though_the_file_changes(tmp_path, tok, monkeypatch):
    """The tokenizer file is overwritten after ``prepare`` read it, as its workers start: they build the
    tokenizer from the pinned bytes, so the shards hold the ids of the copy the data directory keeps."""
    path, text = tmp_path / "tok.json", _code(64 << 10)
    path.write_bytes(Path(tok).read_bytes())
    (tmp_path / "a.txt").write_text(text)
    started = prepare_module.Workers

    def swap_then_start(*args):
        path.write_text("{}")
        return started(*args)

    monkeypatch.setattr(prepare_module, "Workers", swap_then_start)
    _quiet(PrepareOptions((str(tmp_path / "a.txt"),), str(path), str(tmp_path / "out"), 2))
    assert _decoded(tmp_path / "out", tok) == text


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through /proc")
def test_kill_9_of_a_worker_of_the_cli_exits_2_in_one_line(tmp_path, tok):
    """The issue's case as a user meets it: ``trainmesh prepare --workers 2`` on 40 MB, one worker killed
    with ``kill -9`` from outside; the command exits 2 within seconds, one line on stderr, no index."""
    (tmp_path / "big.txt").write_text(_code(40 << 20))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "trainmesh", "prepare", "--input", str(tmp_path / "big.txt"),
                             "--tokenizer", tok, "--out", str(out), "--workers", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline_s = time.monotonic() + 120
    while len(children.read_text().split()) < 2 and time.monotonic() < deadline_s:
        time.sleep(0.05)
    time.sleep(1.0)  # tokenizing by now
    worker = int(children.read_text().split()[0])
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and time.monotonic() - killed_at < 30
    assert re.fullmatch(rf"trainmesh: error: worker [01] \(pid {worker}\) was killed by signal SIGKILL \(out of "
                        rf"memory\?\) while tokenizing {tmp_path}/big\.txt; nothing was kept in {out}\n", err), err
    assert not out.exists()


def test_a_failed_prepare_removes_what_it_wrote_and_keeps_what_was_there(tmp_path, tok, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": _code(300_000)}) + "\n" + '{"text": 5}\n')
    out = tmp_path / "out"
    err = _prepare_error(capsys, "--input", str(tmp_path / "a.jsonl"), "--tokenizer", tok, "--out", str(out),
                         "--workers", "1")
    assert "a.jsonl:2: the 'text' field is int, not a string" in err and not out.exists()
    out.mkdir()
    _prepare_error(capsys, "--input", str(tmp_path / "a.jsonl"), "--tokenizer", tok, "--out", str(out))
    assert out.is_dir() and not any(out.iterdir())


# --- signals and a second run into the same --out -----------------------------------------------------------

def _prepare_cli(src: Path, tok: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainmesh", "prepare", "--input", str(src), "--tokenizer", tok,
                             "--out", str(out), "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the workers through /proc")
def test_sigterm_ends_prepare_with_its_workers_and_keeps_nothing(tmp_path, tok):
    """SIGTERM used to end the parent alone: its workers lived on, re-parented, and the partial shards made
    the rerun refuse the directory. Now the workers end with it, the output goes, and the rerun works."""
    (tmp_path / "big.txt").write_text(_code(12 << 20))
    out = tmp_path / "out"
    proc = _prepare_cli(tmp_path / "big.txt", tok, out)
    deadline_s = time.monotonic() + 60
    while len(workers := child_pids(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline_s:
        time.sleep(0.05)
    while not any(out.glob("*.bin")) and proc.poll() is None and time.monotonic() < deadline_s:
        time.sleep(0.05)  # mid-run: the first shard is being written
    assert proc.poll() is None, "prepare ended before it could be interrupted; give it a larger corpus"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert err == f"trainmesh: error: prepare interrupted by SIGTERM; nothing was kept in {out}\n", err
    gone_by = time.monotonic() + 60  # a bound on a hang only: the workers die with their parent
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert len(workers) == 2 and not any(Path(f"/proc/{w}").exists() for w in workers), "a worker outlived prepare"
    assert not out.exists()
    (tmp_path / "small.txt").write_text(_code(64 << 10))
    rerun = _prepare_cli(tmp_path / "small.txt", tok, out)
    assert rerun.wait(timeout=60) == 0 and is_prepared(str(out))


def test_a_directory_a_prepare_was_cut_off_in_names_the_command_that_clears_it(tmp_path, tok, capsys):
    """What ``kill -9`` of ``prepare`` leaves (shards, no index): the rerun names the way out."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-00000.bin").write_bytes(b"\0" * 64)
    (tmp_path / "a.txt").write_text(_code(4096))
    err = _prepare_error(capsys, "--input", str(tmp_path / "a.txt"), "--tokenizer", tok, "--out", str(out))
    assert err == (f"trainmesh: error: --out {out} exists and is not an empty directory; it holds a partial "
                   f"prepare that was cut off; remove it (rm -r {out}) and run again"), err


def test_two_prepares_into_one_out_at_once_one_succeeds_the_other_is_one_line(tmp_path, tok):
    """Both used to say "prepared ...", their shards and index.json disagreeing."""
    (tmp_path / "a.txt").write_text(_code(2 << 20))
    out = tmp_path / "out"
    runs = [_prepare_cli(tmp_path / "a.txt", tok, out) for _ in range(2)]
    results = [(run.wait(timeout=120), run.stderr.read()) for run in runs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    refused = next(err for rc, err in results if rc == 2)
    assert re.fullmatch(rf"trainmesh: error: --out {out} is in use by another run \(pid \d+ on .+, since .+\); "
                        rf"wait for it to finish or choose another --out\n", refused), refused
    assert is_prepared(str(out)) and _decoded(out, tok) == _code(2 << 20)


# --- text that is not text ------------------------------------------------------------------------------

def test_a_lone_surrogate_and_non_string_columns_are_one_line(tmp_path, tok, capsys):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "ab\\ud800"}\n')
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": pa.array([b"a", b"\xff"], pa.binary())}), tmp_path / "bin.parquet")
    pq.write_table(pa.table({"text": pa.array(["ok", "bad \udcff".encode("utf-8", "surrogatepass")], pa.binary())
                             .cast(pa.string(), safe=False)}), tmp_path / "bad-utf8.parquet")
    datasets.Dataset.from_dict({"text": [1.5]}).save_to_disk(str(tmp_path / "hf"))
    capsys.readouterr()
    cases = {"s.jsonl": r"s.jsonl:2: the 'text' field has a lone surrogate \\ud800 at character 2",
             "ints.parquet": r"ints.parquet: column 'text' holds int64, but prepare reads documents from a string",
             "bin.parquet": r"bin.parquet: column 'text' holds binary, but prepare reads documents from a string",
             "bad-utf8.parquet": r"bad-utf8.parquet row 1 is not UTF-8 text \(invalid byte 0xed at offset 4\)",
             "hf": r"hf: column 'text' holds double, but prepare reads documents from a string \(utf8\) column"}
    for name, message in cases.items():
        err = _prepare_error(capsys, "--input", str(tmp_path / name), "--tokenizer", tok, "--out",
                             str(tmp_path / f"out-{name}"), "--workers", "1")
        assert re.search(message, err), err


# --- the index ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tok) -> Path:
    src = tmp_path_factory.mktemp("docs")
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 3))
    out = src.parent / "prepared"
    _quiet(PrepareOptions((str(src),), tok, str(out), 1, shard_tokens=300, val_fraction=0.2))
    return out


def _copy(prepared: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in prepared.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _load(root: Path):
    data_vocab_size(str(root), "")
    return TokenData.load(str(root), seq_len=8, verify=True)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(dtype="uint8"), r"dtype 'uint8' is not what prepare writes for a vocabulary of 300 "
                                        r"\(uint16; it writes only uint16 or uint32"),
    (lambda r: r.update(dtype="int16"), r"dtype 'int16' is not what prepare writes"),
    (lambda r: r.update(dtype="float32"), r"dtype 'float32' is not what prepare writes"),
    (lambda r: r.update(dtype="uint32"), r"dtype 'uint32' is not what prepare writes for a vocabulary of 300"),
    (lambda r: r["shards"][0].update(tokens=float("nan")), r"shard 0 'tokens' is nan, not an integer"),
    (lambda r: r["shards"][0].update(tokens=float("inf")), r"shard 0 'tokens' is inf, not an integer"),
    (lambda r: r["shards"][0].update(tokens=-4), r"shard 0 'tokens' is -4, outside 0\.\.1152921504606846976"),
    (lambda r: r["shards"][0].update(tokens=12.0), r"shard 0 'tokens' is 12\.0, not an integer"),
    (lambda r: r["shards"][0].update(tokens=True), r"shard 0 'tokens' is True, not an integer"),
    (lambda r: r["shards"][0].update(documents=10**6), r"shard 0 'documents' is 1000000, outside 0\.\."),
    (lambda r: r["tokens"].update(train=r["tokens"]["train"] + 1), r"tokens of train is \d+, not the sum over"),
    (lambda r: r.update(vocab_size=2**40), r"'vocab_size' is 1099511627776, outside 1\.\.4294967296"),
    (lambda r: r.update(eos_id=300), r"'eos_id' is 300, outside 0\.\.299"),
    (lambda r: r["shards"][0].update(file="../index.json"), r"shard 0 is '../index.json' in split 'train', not a"),
    (lambda r: r["shards"].append(r["shards"][0]), r"a shard is listed twice"),
])
def test_an_index_prepare_would_not_write_is_one_line(tmp_path, prepared, capsys, edit, message):
    root = _copy(prepared, tmp_path / "data")
    raw = json.loads((root / INDEX_FILE).read_text())
    edit(raw)
    (root / INDEX_FILE).write_text(json.dumps(raw))
    with pytest.raises(DataError, match=rf"{root / INDEX_FILE}: {message}.*; re-run trainmesh prepare") as e:
        _load(root)
    assert "\n" not in str(e.value)
    assert cli.main(["train", "--steps", "1", "--out", "", "--data", str(root)]) == 2
    assert capsys.readouterr().err.strip() == f"trainmesh: error: {e.value}"


def test_a_token_count_that_disagrees_with_the_file_size_is_one_line(tmp_path, prepared):
    root = _copy(prepared, tmp_path / "data")
    raw = json.loads((root / INDEX_FILE).read_text())
    raw["shards"][0]["tokens"] += 1
    raw["tokens"]["train"] += 1
    (root / INDEX_FILE).write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"train-00000\.bin is truncated: \d+ bytes, index\.json lists \d+ uint16"):
        _load(root)


# --- the fuzzer -----------------------------------------------------------------------------------------

HOSTILE = [None, True, False, -1, 0, 1, 2, 299, 300, 65535, 65536, 2**31, 2**32, 2**63, 10**30, 1.5, 12.0,
           float("nan"), float("inf"), float("-inf"), "", "x", "uint8", "uint16", "uint32", "int16", "float16",
           "<u2", "../index.json", "/dev/zero", "train-00000.bin", "val-00000.bin", "train-99999.bin", "a\nb",
           "0" * 64, [], [0], {}, {"train": 1}, [[1]]]


def _mutate_index(rng: random.Random, raw: dict) -> str:
    container, key = rng.choice(json_nodes(raw))
    how = rng.random()
    if how < 0.5:
        container[key] = rng.choice(HOSTILE)
    elif how < 0.65 and type(container[key]) is int:
        container[key] += rng.choice([-1, 1, -container[key] - 1, 2**20])
    elif how < 0.8:
        del container[key]
    elif how < 0.9 and isinstance(container, dict):
        container[rng.choice(["extra", "a\nb"])] = rng.choice(HOSTILE)
    else:
        other = rng.choice(json_nodes(raw))
        container[key] = json.loads(json.dumps(other[0][other[1]]))
    return f"{how:.2f} at {key!r}"


def _mutate_shard(rng: random.Random, root: Path, raw: dict) -> tuple[str, str]:
    """Damage a shard's bytes, re-hashed in the index as a tamperer would (its count too, sometimes)."""
    entry = rng.choice(raw["shards"])
    path = root / entry["file"]
    data = bytearray(path.read_bytes())
    how = rng.randrange(4)
    if how == 0:
        data = data[:rng.randrange(len(data) + 1)]
    elif how == 1:
        data += bytes(rng.randrange(1, 5))
    else:
        i = rng.randrange(len(data) // 2) * 2
        data[i:i + 2] = rng.choice([299, 300, 65535, 0]).to_bytes(2, "little")
    _put(path, bytes(data))
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    if rng.random() < 0.5:
        entry["tokens"] = len(data) // 2
    return entry["file"], f"shard {entry['file']} {['cut', 'grown', 'id', 'id'][how]}"


def _put(path: Path, data: bytes) -> None:
    """Rewrite in place: truncating to zero first makes ext4 flush on close (auto_da_alloc), 5 ms a write."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()


def _check_loaded(root: Path, data) -> None:
    """A load that succeeded is one prepare could have written: ids within the vocabulary, in the indexed
    dtype, the streams exactly the indexed shards' contents."""
    index = read_index(str(root))
    assert index.dtype == token_dtype(index.vocab_size) and 0 <= index.eos_id < index.vocab_size
    for split, stream in (("train", data.train), ("val", data.val)):
        want = np.concatenate([np.fromfile(root / s.file, dtype=index.dtype) for s in index.split(split)])
        got = stream[0:len(stream)]
        assert np.array_equal(got, want) and int(got.max()) < index.vocab_size


def test_fuzzed_data_indexes_and_shards_load_correctly_or_fail_in_one_line(tmp_path, prepared):
    """1,200 mutants of a real prepared directory (index values, keys and raw bytes; shard bytes cut, grown
    or given out-of-vocabulary ids, re-hashed): each loads data prepare could have written, or is refused
    with a one-line DataError naming a file of the directory; none raises anything else or hangs."""
    root = _copy(prepared, tmp_path / "data")
    pristine = {f.name: f.read_bytes() for f in root.iterdir()}
    text = pristine[INDEX_FILE].decode()
    rng = random.Random(33)
    outcomes = {"loaded": 0, "refused": 0}
    start = time.monotonic()
    for case in range(1200):
        raw, shard = json.loads(text), None
        if case % 5 == 4:
            shard, what = _mutate_shard(rng, root, raw)
        else:
            what = _mutate_index(rng, raw)
        data = json.dumps(raw, allow_nan=True).encode()
        if rng.random() < 0.08:
            i = rng.randrange(len(data))
            data, what = (data[:i] if rng.random() < 0.5 else data[:i] + bytes([data[i] ^ 1 << rng.randrange(8)])
                          + data[i + 1:]), "raw bytes"
        _put(root / INDEX_FILE, data)
        label = f"case {case} ({what})"
        try:
            with deadline(5):
                _check_loaded(root, _load(root))
            outcomes["loaded"] += 1
        except CaseTimeout:
            pytest.fail(f"{label} hung")
        except DataError as e:
            message = str(e)
            assert "\n" not in message and str(root) in message, f"{label}: {message!r}"
            outcomes["refused"] += 1
        if shard is not None:
            _put(root / shard, pristine[shard])
    elapsed = time.monotonic() - start
    print(f"data index fuzzer: {outcomes} in {elapsed:.1f} s")
    assert outcomes["refused"] > 800 and outcomes["loaded"] > 20, outcomes
    assert elapsed < 60


@pytest.mark.parametrize("flag,value,want", [("--workers", "0", "1 to 1024"), ("--workers", "100000", "1 to 1024"),
                                             ("--shard-tokens", "0", "at least 1"),
                                             ("--val-fraction", "1.0", "in (0, 1)")])
def test_prepare_numbers_out_of_range_are_one_line_before_any_work(tmp_path, tok, capsys, flag, value, want):
    (tmp_path / "a.txt").write_text("text")
    err = _prepare_error(capsys, "--input", str(tmp_path / "a.txt"), "--tokenizer", tok, "--out",
                         str(tmp_path / "out"), flag, value)
    assert err.startswith(f"trainmesh: error: {flag} {value}: must be {want}") and "\n" not in err
    assert not (tmp_path / "out").exists()
