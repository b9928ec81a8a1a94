"""What the fuzzers share (checkpoint manifests, data indexes): every place in a JSON document a mutation
can hit, and a per-case deadline, so a mutant that hangs fails its case instead of the whole suite."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class CaseTimeout(Exception):
    """A fuzz case ran past its deadline."""


def json_nodes(value: Any, out: list | None = None) -> list:
    """Every (container, key) in a JSON value."""
    out = [] if out is None else out
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append((value, k))
        json_nodes(v, out)
    return out


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the block after ``seconds`` (SIGALRM: the main thread only)."""
    def expire(*_):
        raise CaseTimeout()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
