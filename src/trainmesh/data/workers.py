"""The tokenizing workers of ``trainmesh prepare``: batches out, results back in input order, and a worker
that dies ends the command at once (``multiprocessing.Pool`` would wait forever for its lost task).
Each worker holds one batch over its own pipe; the parent waits on pipes and sentinels together, and
workers die with their parent (``PR_SET_PDEATHSIG``, else within ``POLL_S``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from trainmesh.data.text import DataError

if TYPE_CHECKING:
    from trainmesh.data.tokenizer import TokenizerFile

POLL_S = 1.0
JOIN_S = 5.0


class WorkerDied(DataError):
    """A tokenizing worker process died or failed; the message names it, its input and the signal."""


@dataclass(frozen=True)
class Failure:
    """What a worker sends back instead of tokens when tokenizing raised."""

    message: str


def tokenize(tokenizer: Any, dtype: np.dtype, batch: list[tuple[str, bool]]) -> list[np.ndarray]:
    """Token ids of each piece, the end-of-document id after each piece that ends a document."""
    ids = tokenizer.encode_batch([text for text, _ in batch])
    eos = [tokenizer.eos_id]
    return [np.asarray(i + eos if ends else i, dtype=dtype) for i, (_, ends) in zip(ids, batch)]


def _serve(conn: Connection, pinned: TokenizerFile | None, dtype: str, parent: int) -> None:
    """A worker: build the tokenizer once from the parent's pinned bytes, its thread pool off, and tokenize batches
    until stopped or orphaned; SIGTERM ends it at once (not through the parent's inherited handler)."""
    from trainmesh.distributed.launcher import _die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    if os.getppid() != parent:  # it died before the line above
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from trainmesh.data.tokenizer import load_tokenizer

    tok, dt = pinned.load() if pinned else load_tokenizer(""), np.dtype(dtype)
    while True:
        while not conn.poll(POLL_S):
            if os.getppid() != parent:
                return
        try:
            batch = conn.recv()
        except EOFError:  # the parent closed its end
            return
        if batch is None:
            return
        try:
            result: Any = tokenize(tok, dt, batch)
        except Exception as e:  # the tokenizer's own errors, e.g. from its Rust side
            result = Failure(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        conn.send(result)


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"was killed by signal {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exited with code {code}"


class Workers:
    """``n`` tokenizing processes; :meth:`ordered` maps batches to token ids in input order."""

    def __init__(self, n: int, pinned: TokenizerFile | None, dtype: np.dtype) -> None:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        try:
            for _ in range(n):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(theirs, pinned, dtype.str, os.getpid()), daemon=True)
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(mine)
        except BaseException:
            self.kill()
            raise

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        """Stopped after their last batch on success, killed at once on any failure."""
        if kind is None:
            self.close()
        else:
            self.kill()

    def ordered(self, batches: Iterator[tuple[Any, str]]) -> Iterator[Any]:
        """The result of each ``(batch, label)`` in order (``label``: the inputs it came from, for errors).
        At most two batches per worker are ahead of the one due next, which bounds the parent's memory."""
        idle, busy = list(range(len(self.procs)))[::-1], {}
        done: dict[int, Any] = {}
        sent = due = 0
        limit = 2 * len(self.procs)
        pending = next(batches, None)
        while pending is not None or busy or done:
            while idle and pending is not None and sent - due < limit:
                w = idle.pop()
                self._send(w, pending[0], pending[1])
                busy[w] = (sent, pending[1])
                sent, pending = sent + 1, next(batches, None)
            if due in done:
                yield done.pop(due)
                due += 1
                continue
            for w, k, result in self._receive(busy):
                busy.pop(w)
                idle.append(w)
                done[k] = result

    def _send(self, w: int, batch: Any, label: str) -> None:
        try:
            self.conns[w].send(batch)
        except OSError:
            self._raise_dead(w, label)

    def _receive(self, busy: dict[int, tuple[int, str]]) -> list[tuple[int, int, Any]]:
        """Wait for at least one result, and return those that arrived; a dead or failed worker raises."""
        sentinels = {p.sentinel: w for w, p in enumerate(self.procs)}
        readers = {self.conns[w]: w for w in busy}
        ready = wait([*readers, *sentinels])
        for dead in (sentinels[s] for s in ready if s in sentinels):
            self._raise_dead(dead, busy[dead][1] if dead in busy else "nothing (it was idle)")
        results = []
        for conn in (c for c in ready if c in readers):
            w = readers[conn]
            k, label = busy[w]
            try:
                result = conn.recv()
            except (EOFError, OSError):
                self._raise_dead(w, label)
            if isinstance(result, Failure):
                self.kill()
                raise WorkerDied(f"worker {w} (pid {self.procs[w].pid}) failed tokenizing {label}: "
                                 f"{result.message}")
            results.append((w, k, result))
        return results

    def _raise_dead(self, w: int, label: str) -> None:
        proc = self.procs[w]
        proc.join(JOIN_S)
        self.kill()
        raise WorkerDied(f"worker {w} (pid {proc.pid}) {_how(proc.exitcode)} while tokenizing {label}")

    def close(self) -> None:
        """Stop the workers after their last batch."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(JOIN_S)
        self.kill()

    def kill(self) -> None:
        """End every worker now (after a failure, or when the parent is interrupted)."""
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
