"""A key/value cache for autoregressive decoding, and the causal attention that reads it: each step runs only the new
tokens, attending over stored keys and values (Pope et al., 2022, §2); ``cache=None`` is the unchanged training path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.models.blocked_attention import blocked_attention


class LayerCache:
    """One attention layer's keys and values (``[batch, kv_heads, position, head_dim]``) for the first
    ``length`` positions, in buffers of ``max_len`` positions allocated on the first write."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' ``k`` and ``v``; returns the keys and values of every position so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions and {end} were asked for; start a new "
                             f"cache with a shorter context")
        if self._k is None:
            self._k = k.new_empty(*k.shape[:2], self.max_len, k.shape[3])
            self._v = v.new_empty(*v.shape[:2], self.max_len, v.shape[3])
        self._k[:, :, self.length:end] = k
        self._v[:, :, self.length:end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]


class KVCache:
    """A :class:`LayerCache` per block of a model (keyed like ``model.blocks``); ``length`` is the number
    of positions already decoded, so the next tokens' positions start there."""

    def __init__(self, model: nn.Module, max_len: int) -> None:
        self.layers = {name: LayerCache(max_len) for name in model.blocks}

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length


WINDOW_BLOCK = 64  # query rows per block: smaller blocks compute fewer masked scores but cost more kernel calls


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                     block: int = WINDOW_BLOCK, documents: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention where the queries are the last ``q.shape[2]`` key positions, within ``window``
    keys when given (transformers' mask: key j visible to query i iff i - window < j <= i), within each query's
    own document when ``documents`` (``[batch, k_len]`` document index of every key position) is given, and with
    each head's ``sinks`` logit in the softmax's denominator (GPT-OSS). Any of them runs
    :func:`~trainmesh.models.blocked_attention.blocked_attention`, ``block`` queries at a time, which computes
    only the visible scores' blocks; plain causal attention is SDPA's ``is_causal`` (or a bottom-right mask)."""
    q_len, k_len = q.shape[2], k.shape[2]
    if window is not None and window >= k_len:
        window = None
    if window is not None or documents is not None or sinks is not None:
        return blocked_attention(q, k, v, window, block, documents, sinks)
    if q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
