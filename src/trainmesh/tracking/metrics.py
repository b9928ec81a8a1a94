"""What a step costs, measured: memory a rank holds (model state, saved activations, peak RSS and device
memory) and FLOPs (model FLOPs per token, MFU). ``model_state_bytes`` counts each storage once, the
quantity the ZeRO paper's formulas predict."""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
from collections.abc import Iterable, Iterator, Sequence

import torch

from trainmesh.distributed.comm import log_all_gather
from trainmesh.distributed.hardware import device_peak


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def model_state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's state tensors of a replicated model."""
    params = list(model.parameters())
    return params + [p.grad for p in params if p.grad is not None] + optimizer_tensors(optimizer)


class SavedActivations:
    """Bytes of the tensors autograd saves for backward while active, parameters excluded (recomputed ones
    are never saved). Parameters are recognised by their storage at pack time, since ZeRO-3 re-allocates."""

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._exclude = list(exclude)
        self._seen: dict[int, int] = {}
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # a wrapper subclass (torchao's float8 tensor, saved by fp8 tp linears) has only its inner tensors' storage
        parts = [getattr(t, name) for name in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
        params = {p.untyped_storage().data_ptr() for p in self._exclude}
        for storage in (part.untyped_storage() for part in parts):
            if storage.data_ptr() not in params:
                self._seen[storage.data_ptr()] = storage.nbytes()
        return t.detach()  # not t: a saved output would hold its own node, and the graph with it, under retain_graph

    @contextlib.contextmanager
    def recording(self) -> Iterator["SavedActivations"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self.bytes = sum(self._seen.values())


def max_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports kilobytes, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_tflops(device: torch.device, precision: str, override: float = 0.0) -> float:
    """The per-device peak that MFU divides by: ``override`` if given, else the row of the one table of device peaks
    (:data:`trainmesh.distributed.hardware.DEVICE_PEAKS`) at ``precision``; 0 if unknown (a CPU, an unlisted GPU)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return 0.0
    peak = device_peak(torch.cuda.get_device_name(device))
    return peak.at(precision) / 1e12 if peak is not None else 0.0


def block_flops_per_token(d_model: int, d_ff: int, seq_len: int, gated_mlp: bool = False,
                          qkv_width: int | None = None, attention_width: int | None = None) -> int:
    """Forward FLOPs of one block per token: 2 per matmul weight and 4sh for QK^T and AV (Narayanan et al., 2021, app.
    "FLOPs"), biases, norms and softmax left out; ``qkv_width`` and ``attention_width`` cover GQA and a set head_dim."""
    heads = attention_width or d_model
    weights = ((qkv_width or 3 * d_model) + heads) * d_model + (3 if gated_mlp else 2) * d_model * d_ff
    return 2 * weights + 4 * seq_len * heads


def head_flops_per_token(d_model: int, vocab_size: int) -> int:
    """Forward FLOPs of the output projection per token (the V/(16lh) term of Megatron-LM's appendix)."""
    return 2 * d_model * vocab_size


def mfu(tokens_per_s: float, flops_per_token: int, world_size: int, peak: float) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (TFLOP/s) of all devices (None if unknown)."""
    return tokens_per_s * flops_per_token / (world_size * peak * 1e12) if peak > 0 else None


def peak_device_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


PER_RANK_STATS = ("max_rss_bytes", "model_state_bytes", "peak_device_bytes", "activation_bytes")


def per_rank_stats(state: Iterable[torch.Tensor | None], device: torch.device,
                   activation_bytes: int = 0, split: tuple[float, float] | None = None) -> dict[str, list]:
    """Peak RSS, bytes of model ``state``, peak device memory and saved activation bytes of one micro-batch
    of every rank, gathered to all (a collective: every rank calls it), as a run's records hold them; with
    ``split`` (this rank's step seconds computing and waiting for peers) each rank's split too, in the same
    gather, so naming stragglers costs no collective of its own."""
    timing = [round(seconds * 1e6) for seconds in split] if split else []
    mine = torch.tensor([max_rss_bytes(), storage_bytes(state), peak_device_bytes(device), activation_bytes, *timing],
                        dtype=torch.int64, device=device)
    rows = log_all_gather(mine).tolist()
    stats: dict[str, list] = {name: [r[k] for r in rows] for k, name in enumerate(PER_RANK_STATS)}
    if split:
        stats.update({name: [r[len(PER_RANK_STATS) + k] / 1e6 for r in rows] for k, name in enumerate(SPLIT)})
    return stats


SPLIT = ("compute_s", "wait_s")
"""A step's seconds on each rank: computing, and blocked waiting for peers (collectives, messages)."""
STRAGGLER_FACTOR = 1.5
STRAGGLER_MIN_S = 0.05
"""A rank is a straggler when it computed more than STRAGGLER_FACTOR x the median rank and STRAGGLER_MIN_S
more (below that, scheduling noise on a shared host crosses any factor in a step of milliseconds)."""


def stragglers(compute_s: Sequence[float]) -> list[int]:
    """The ranks whose step's compute exceeds the median's by STRAGGLER_FACTOR (the lower median: of two ranks,
    the faster is the yardstick), the others having waited for them."""
    median = statistics.median_low(compute_s)
    return [r for r, c in enumerate(compute_s) if c > STRAGGLER_FACTOR * median and c - median > STRAGGLER_MIN_S]
