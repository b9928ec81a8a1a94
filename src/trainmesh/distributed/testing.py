"""A small harness that runs a function on N ranks (processes on 127.0.0.1) and returns their results, as
PyTorch's ``MultiProcessTestCase`` or DeepSpeed's ``DistributedTest``: a rank that raises, dies or
outlives ``timeout`` fails the call with its number and traceback, and the others are killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainmesh.distributed.launcher import host_store, rank_env
from trainmesh.distributed.mesh import shutdown_distributed
from trainmesh.distributed.shm import new_job, remove_segments


class RankFailure(AssertionError):
    """A rank raised, died, or did not finish in time."""


def _rank_main(fn: Callable, args: tuple, env: dict[str, str], result_dir: str, rank: int) -> None:
    os.environ.update(env)
    try:
        result = fn(*args)
    except BaseException:
        Path(result_dir, f"{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    torch.save(result, Path(result_dir, f"{rank}.pt"))
    shutdown_distributed()


def _kill_all(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def _context() -> mp.context.BaseContext:
    """Ranks fork from a server process that imported torch and trainmesh once (a second of CPU per spawned rank
    otherwise); it never computes, so forking it is safe."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "trainmesh.api", "trainmesh.data"])
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; returns each rank's return value, in rank order."""
    ctx = _context()
    store, port = host_store()
    job = new_job()
    with tempfile.TemporaryDirectory() as result_dir:
        procs = []
        for rank in range(world_size):
            env = rank_env(rank, world_size, port, job)
            p = ctx.Process(target=_rank_main, args=(fn, args, env, result_dir, rank), daemon=True)
            p.start()
            procs.append(p)
        try:
            _wait(procs, result_dir, timeout)
        finally:
            _kill_all(procs)
            del store
            remove_segments(job)
        return [torch.load(Path(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def _raise_if_failed(procs: list[mp.Process], result_dir: str) -> None:
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0):
            err = Path(result_dir, f"{rank}.err")
            detail = err.read_text() if err.exists() else f"exit code {p.exitcode}"
            raise RankFailure(f"rank {rank} failed:\n{detail}")


def _wait(procs: list[mp.Process], result_dir: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        _raise_if_failed(procs, result_dir)
        if time.monotonic() > deadline:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            raise RankFailure(f"rank(s) {hung} did not finish within {timeout:.0f}s")
        time.sleep(0.05)
    _raise_if_failed(procs, result_dir)
