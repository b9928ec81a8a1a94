"""Replica-group continuation on the namespace test bed: each node is one torchft replica group (two ranks,
ZeRO-2 inside); node 1 is killed mid-run and node 0 trains on alone. Prints, per run, the survivor's normal step
time, the seconds from the kill to its next trained step, the seconds it lost beyond one step, and the steps of
work it gave up; asserts nothing. :func:`measure` is what ``make bench-recovery`` calls for its column."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NODES, PER_NODE = 2, 2
LIGHTHOUSE_PORT, STORE_PORT = 29510, 29653
KILLED = 1


def rank_main(replica: int, lighthouse: str, model: str, steps: int, global_batch: int, log: str) -> None:
    """One rank of replica group ``replica``: ``steps`` committed steps through torchft; the group's first rank
    appends each attempt (step, end time, committed, groups averaged) to ``log`` as a JSON line."""
    import torch

    import trainmesh as tm
    from trainmesh.models.gpt import GPT, PRESETS
    from trainmesh.replicas import ReplicaGroup

    cfg = PRESETS[model]
    pm = tm.parallelize(GPT(cfg, seed=0), tm.init_mesh(dp=PER_NODE), zero=2)
    opt = tm.optimizer(pm, lr=1e-3)
    group = ReplicaGroup(pm, opt, lighthouse, replica, timeout_s=10.0)
    gen = torch.Generator().manual_seed(replica)
    batch = tuple(torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len), generator=gen) for _ in range(2))
    while (step := group.start_step()) < steps:
        participants = group.participants
        tm.train_step(pm, opt, batch)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"step": step, "end": time.time(), "participants": participants,
                                    "committed": group.manager.current_step() == step + 1}) + "\n")
    group.close()


def _attempts(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def figures(attempts: list[dict], killed_at: float) -> dict:
    """From the survivor's attempts and the kill's time: its median step before the kill (both groups) and after
    it (alone), the seconds from the kill to its next committed step, the seconds of those beyond one step
    alone (what the loss cost it), and the attempts it gave up (steps of work lost)."""
    ends = lambda rows: [a["end"] for a in rows if a["committed"]]
    median_step = lambda e: statistics.median(b - a for a, b in zip(e, e[1:]))
    after = [a for a in attempts if a["end"] >= killed_at]
    first = next(a for a in after if a["committed"])
    alone_s = median_step(ends(after[after.index(first):]))
    to_step = first["end"] - killed_at
    return {"step_s": median_step(ends(a for a in attempts if a["end"] < killed_at)), "alone_step_s": alone_s,
            "kill_to_step_s": to_step, "lost_s": max(0.0, to_step - alone_s),
            "steps_lost": sum(1 for a in after[:after.index(first)] if not a["committed"])}


def measure(bed, model: str = "small", steps: int = 24, kill_after: int = 8, global_batch: int = 8,
            heartbeat_ms: int = 500, join_ms: int = 200, workdir: Path | None = None) -> dict:
    """On ``bed`` (:class:`~trainmesh.distributed.testbed.TestBed` of 2 nodes): a lighthouse and replica group 0 on
    node 0, replica group 1 on node 1, killed (every process of the node) once it has committed ``kill_after``
    steps; the survivor's :func:`figures`. ``heartbeat_ms`` is how long the lighthouse waits for a silent group.
    Node 1's processes are gone afterwards; the bed's namespaces stay for the next case."""
    work = Path(workdir or tempfile.mkdtemp())
    lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{LIGHTHOUSE_PORT}",
                  "--min_replicas", "1", "--join_timeout_ms", str(join_ms), "--heartbeat_timeout_ms", str(heartbeat_ms)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    beacon = bed.start(0, lighthouse, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://{bed.members[0].addr}:{LIGHTHOUSE_PORT}"
    logs = [work / f"replica{k}.jsonl" for k in range(NODES)]
    argv = lambda k: [sys.executable, "-m", "trainmesh", "launch", "--nproc", str(PER_NODE), "--master-port",
                      str(STORE_PORT), __file__, "--rank", str(k), "--lighthouse", address, "--model", model,
                      "--steps", str(steps), "--global-batch", str(global_batch), "--log", str(logs[k])]
    procs = [bed.start(k, argv(k), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(NODES)]
    try:
        killed_at = _kill_after(bed, procs, logs[KILLED], kill_after)
        err = procs[0].communicate(timeout=1800)[1]
    finally:
        beacon.kill()
    if procs[0].returncode:
        raise SystemExit(f"the surviving group failed:\n{err[-3000:]}")
    return figures(_attempts(logs[0]), killed_at)


def _kill_after(bed, procs: list[subprocess.Popen], log: Path, steps: int) -> float:
    """Wait until the group logging to ``log`` has committed ``steps`` steps, kill its node; the kill's time."""
    deadline = time.monotonic() + 1800
    while sum(a["committed"] for a in _attempts(log)) < steps:
        if procs[KILLED].poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"group {KILLED} ended before its kill:\n{procs[KILLED].communicate()[1][-3000:]}")
        time.sleep(0.01)
    killed_at = time.time()
    bed.kill_node(KILLED)
    return killed_at


HEADER = (f"{'case':<22} {'step s':>8} {'alone s':>8} {'kill->step s':>13} {'lost s':>8} {'steps lost':>11}")


def report_row(name: str, r: dict) -> str:
    return (f"{name:<22} {r['step_s']:>8.3f} {r['alone_step_s']:>8.3f} {r['kill_to_step_s']:>13.3f} "
            f"{r['lost_s']:>8.3f} {r['steps_lost']:>11d}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--heartbeat-ms", type=int, default=500)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)  # the replica, inside a rank
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--log", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank >= 0:
        rank_main(args.rank, args.lighthouse, args.model, args.steps, args.global_batch, args.log)
        return 0
    from trainmesh.distributed.testbed import TestBed, missing_capability

    reason = missing_capability()
    if reason:
        print(f"bench replicas: skipped: {reason}")
        return 0
    print(f"{NODES} nodes x {PER_NODE} ranks, link {args.rate_mbit:g} Mbit/s, model {args.model}, one torchft replica "
          f"group per node (ZeRO-2 inside), node {KILLED} killed after {args.kill_after} steps; lighthouse "
          f"heartbeat timeout {args.heartbeat_ms} ms")
    print(HEADER)
    with TestBed(NODES, rate_mbit=args.rate_mbit) as bed:
        r = measure(bed, args.model, args.steps, args.kill_after, args.global_batch, args.heartbeat_ms)
    print(report_row("replica continuation", r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
