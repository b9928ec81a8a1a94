"""Forward FLOPs per token of a block (dense or MoE), on which step FLOPs and MFU are built.

A block is 2 FLOPs per weight of its matmuls plus 4sh for QK^T and AV [NAR, app. FLOPs], which is what
:func:`trainmesh.metrics.block_flops_per_token` counts for the runtime's MFU, so the planner's MFU and the
runtime's agree for every model trainmesh builds.
"""

from __future__ import annotations

from trainmesh.metrics import block_flops_per_token
from trainmesh.models.spec import ModelShape


def block_forward_flops(m: ModelShape, seq_len: int, moe: bool = False) -> int:
    """Forward FLOPs of one block per token. An MoE block (``moe``) is a dense block whose MLP is ``top_k``
    routed plus the shared experts (an MLP of their summed width), and the router's d x E matmul: active
    parameters, not total."""
    if not moe:
        return block_flops_per_token(m.d_model, m.d_ff, seq_len, m.gated_mlp, m.qkv_width)
    width = (m.top_k + m.n_shared_experts) * m.expert_ff
    return block_flops_per_token(m.d_model, width, seq_len, m.gated_mlp, m.qkv_width) + 2 * m.d_model * m.n_experts


def is_moe_layer(m: ModelShape, layer: int) -> bool:
    """Whether block ``layer`` (from 0) holds experts: all after the first ``n_dense_layers`` of an MoE model."""
    return m.n_experts > 0 and layer >= m.n_dense_layers
