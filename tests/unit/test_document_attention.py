"""Attention confined to documents equals running each document alone."""

import torch

from trainmesh.models.cache import causal_attention


def test_each_document_attends_only_to_itself():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, dtype=torch.float64) for _ in range(3))
    documents = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    out = causal_attention(q, k, v, documents=documents)
    alone = [causal_attention(q[:1, :, a:b], k[:1, :, a:b], v[:1, :, a:b]) for a, b in ((0, 4), (4, 10))]
    torch.testing.assert_close(out[:1], torch.cat(alone, dim=2), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1:], causal_attention(q[1:], k[1:], v[1:]), rtol=0, atol=1e-12)
