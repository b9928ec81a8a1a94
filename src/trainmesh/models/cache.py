"""A key/value cache for autoregressive decoding, and the causal attention that reads it: each step runs only the new
tokens, attending over stored keys and values (Pope et al., 2022, §2); ``cache=None`` is the unchanged training path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


WINDOW_BLOCK = 256  # query rows per band: smaller bands compute fewer masked keys but cost more per key on CPU


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                     block: int = WINDOW_BLOCK, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention where the queries are the last ``q.shape[2]`` key positions, within ``window``
    keys when given (transformers' mask: key j visible to query i iff i - window < j <= i), and within each query's
    own document when ``documents`` (``[batch, k_len]`` document index of every key position) is given. A window shorter
    than the keys runs ``block`` queries at a time, each over only the band of keys its window reaches, so the
    work is O(seq * (window + block)) rather than O(seq^2); the bands are views of the keys, so backward saves
    no copies of them. Equal lengths take SDPA's ``is_causal``; otherwise an explicit bottom-right-aligned mask."""
    q_len, k_len = q.shape[2], k.shape[2]
    if documents is not None:
        return _within_documents(q, k, v, window, documents)
    if window is not None and window < k_len:
        return torch.cat([_band(q, k, v, window, start, min(start + block, q_len))
                          for start in range(0, q_len, block)], dim=2)
    if q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, start: int, end: int) -> torch.Tensor:
    """Queries ``start:end`` over the keys their window reaches, [first - window + 1, last], exactly masked."""
    first, last = start + k.shape[2] - q.shape[2], end - 1 + k.shape[2] - q.shape[2]  # their key positions
    low = max(0, first - window + 1)
    q_pos = torch.arange(first, last + 1, device=q.device)[:, None]
    k_pos = torch.arange(low, last + 1, device=q.device)
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    return F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, low:last + 1], v[:, :, low:last + 1],
                                          attn_mask=mask)


def _within_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                      documents: torch.Tensor) -> torch.Tensor:
    """Causal (and windowed) attention confined to each token's document: an explicit ``[batch, 1, q, k]`` mask."""
    q_len, k_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    if window is not None:
        mask &= ~torch.ones_like(mask).tril(k_len - q_len - window)
    same = documents[:, k_len - q_len:, None] == documents[:, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(mask & same).unsqueeze(1))
