"""``make bench-recovery``: what losing a node costs an elastic run on the namespace test bed, per recovery mode.

Nodes of two ranks, joined by a rate-limited link, train under ``trainmesh launch --nnodes 1:N`` (torch's
elastic agent); once step :data:`KILL_AFTER` is logged (a step or two may run on meanwhile) the last node is
killed, its memory (its snapshot directory) with it. Per mode it prints the seconds from the kill to the next trained step, the steps of work
lost (done before the kill, less the step the survivors went on from), the seconds until they trained past
the step reached before the kill, and the restart's reload line. Prints;
asserts nothing. Figures: docs/multinode.md#restart-from-memory."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PER_NODE = 2
PORT = 29661
KILL_AFTER = 7
CHECKPOINT_EVERY = 4
RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
"""A lost node is declared after two missed 1 s keep-alives (torch: 3 x 5 s), and the round closes 1 s after
the survivors meet."""


@dataclass(frozen=True)
class Mode:
    """One column of the table: the ``train`` flags that choose how a run recovers from a lost node."""

    name: str
    flags: list[str] = field(default_factory=list)


MODES = [Mode("restart-from-disk"), Mode("restart-from-peer-memory", ["--memory-snapshot", "every-step"])]
"""The recovery modes measured side by side. Replica-group continuation joins as one more :class:`Mode` whose
flags make the hybrid-sharded replica groups go on without a restart: its survivors' next logged step and the
steps they lost are measured the same way."""


@dataclass
class Outcome:
    """A mode's figures: the step the kill followed, seconds from the kill to the next logged step, steps lost,
    seconds from the kill until a step past ``done`` was logged, and how it reloaded."""

    done: int
    seconds: float | None
    lost: int | None
    caught_up: float | None
    reload: str


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def _wait_for(predicate, seconds: float, procs: list[subprocess.Popen]) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        if procs[0].poll() is not None:
            return predicate()
        time.sleep(0.05)
    return False


def _next_step(path: Path, done: int, restarts: int) -> dict | None:
    """The first step trained after the kill: a restart's first record (the log gives way to it from the step it
    resumes at), or a step past ``done`` where the survivors went on without one."""
    records = _records(path)
    if sum("restart" in r for r in records) > restarts:
        return [r for r in records if "restart" in r][-1]
    return next((r for r in records if r["step"] > done), None)


def _reload_line(log: Path) -> str:
    """How the restart reloaded, and what a memory snapshot cost, as rank 0 said them."""
    text = log.read_text(errors="replace")
    found = re.findall(r"trainmesh: (resumed from .*)", text)
    cost = re.findall(r"trainmesh: memory (snapshots: .*)", text)
    return (found[-1] if found else "no reload line") + (f"; {cost[0]}" if cost else "")


def measure(mode: Mode, args: argparse.Namespace, tmp: Path) -> Outcome:
    """Run ``mode`` on a fresh bed, kill its last node after step :data:`KILL_AFTER`, and time the recovery."""
    from trainmesh.distributed.testbed import TestBed

    out, ckpt = tmp / mode.name / "run", tmp / mode.name / "ckpt"
    memory = [Path(f"/dev/shm/trainmesh-bench-{os.getpid()}-{mode.name}-node{k}") for k in range(args.nodes)]
    train = ["train", "--model", args.model, "--dp", str(args.nodes * PER_NODE), "--steps", str(args.steps),
             "--global-batch", str(args.global_batch), "--checkpoint-every", str(CHECKPOINT_EVERY), "--resume",
             "--checkpoint-dir", str(ckpt), "--out", str(out), "--no-progress", *mode.flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_HOST_TRANSPORT": "auto"}
    with TestBed(args.nodes, rate_mbit=args.rate_mbit) as bed:
        argv = [sys.executable, "-m", "trainmesh", "launch", "--nnodes", f"1:{args.nodes}", "--nproc-per-node",
                str(PER_NODE), "--rdzv-endpoint", f"{bed.members[0].addr}:{PORT}", "--rdzv-id", "recovery",
                "--rdzv-conf", RDZV_CONF, *train]
        logs = [tmp / mode.name / f"node{k}.log" for k in range(args.nodes)]
        procs = [bed.start(k, argv, env={**env, "TRAINMESH_SNAPSHOT_DIR": str(memory[k])},
                           stdout=subprocess.DEVNULL, stderr=logs[k].open("w")) for k in range(args.nodes)]
        try:
            if not _wait_for(lambda: any(r["step"] >= KILL_AFTER for r in _records(out / "metrics.jsonl")), 600, procs):
                raise SystemExit(f"{mode.name}: step {KILL_AFTER} was never logged:\n{logs[0].read_text()[-3000:]}")
            bed.kill_node(args.nodes - 1)
            killed = time.monotonic()
            shutil.rmtree(memory[-1], ignore_errors=True)  # the lost node's memory goes with it
            before = _records(out / "metrics.jsonl")
            done, restarts = max(r["step"] for r in before), sum("restart" in r for r in before)
            ok = _wait_for(lambda: _next_step(out / "metrics.jsonl", done, restarts) is not None, args.wait, procs)
            seconds = time.monotonic() - killed if ok else None
            following = _next_step(out / "metrics.jsonl", done, restarts) if ok else None
            resumed = following.get("restart", {}).get("from_step", done) if following else None
            ahead = _wait_for(lambda: max((r["step"] for r in _records(out / "metrics.jsonl")), default=0) > done,
                              args.wait, procs)
            caught_up = time.monotonic() - killed if ahead else None
            procs[0].wait(timeout=args.wait)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for path in memory:
                shutil.rmtree(path, ignore_errors=True)
        return Outcome(done, seconds, None if resumed is None else done - resumed, caught_up,
                       _reload_line(logs[0]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", default="small")  # steps long enough for the kill to land mid-run in every mode
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--wait", type=float, default=180.0, help="seconds to wait for the survivors' next step")
    args = parser.parse_args(argv)
    from trainmesh.distributed.testbed import missing_capability

    reason = missing_capability()
    if reason:
        print(f"bench-recovery: skipped: {reason}")
        return 0
    print(f"{args.nodes} nodes x {PER_NODE} ranks, link {args.rate_mbit:g} Mbit/s each way (tbf), model {args.model}, "
          f"checkpoint every {CHECKPOINT_EVERY} steps, last node killed after step {KILL_AFTER}, --rdzv-conf {RDZV_CONF}")
    print(f"{'mode':<26} {'killed after step':>18} {'kill -> next step s':>20} {'steps lost':>11} "
          f"{'kill -> past it s':>18}  reload")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            (Path(tmp) / mode.name).mkdir()
            r = measure(mode, args, Path(tmp))
            seconds = f"{r.seconds:.1f}" if r.seconds is not None else f">{args.wait:g}"
            lost = str(r.lost) if r.lost is not None else "-"
            past = f"{r.caught_up:.1f}" if r.caught_up is not None else f">{args.wait:g}"
            print(f"{mode.name:<26} {r.done:>18} {seconds:>20} {lost:>11} {past:>18}  {r.reload}", flush=True)
    print(replica_row(args), flush=True)
    return 0


def replica_row(args: argparse.Namespace) -> str:
    """The same kill against two torchft replica groups, one a node (:func:`trainmesh_bench.replicas.measure`):
    the survivor goes on without a restart, so its row gives the seconds it lost beyond a step of its own and the
    attempts it gave up; "-" where the ``ft`` extra is missing."""
    from trainmesh.distributed.testbed import TestBed
    from trainmesh_bench import replicas

    name = "replica-group continuation"
    if importlib.util.find_spec("torchft") is None:
        return f"{name:<26} - (pip install 'trainmesh[ft]')"
    with TestBed(args.nodes, rate_mbit=args.rate_mbit) as bed:
        r = replicas.measure(bed, args.model, max(args.steps, KILL_AFTER + 4), KILL_AFTER, args.global_batch)
    return (f"{name:<26} {KILL_AFTER:>18} {r['kill_to_step_s']:>20.1f} {r['steps_lost']:>11} {'-':>18}  no restart: "
            f"{r['lost_s']:.2f} s lost beyond a {r['alone_step_s']:.2f} s step alone ({r['step_s']:.2f} s with both)")


if __name__ == "__main__":
    sys.exit(main())
