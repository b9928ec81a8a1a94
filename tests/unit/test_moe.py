"""The MoE layer on one process, in float64 against a naive reference that routes one token at a time:
outputs and every gradient (aux and z losses included) for each router variant (group-limited routing
included), dropless and with a capacity; the two expert-product implementations against each other; the
balance and z losses by hand.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from trainmesh.models import gpt, llama, moe, spec_of
from trainmesh.models.moe import MoE, MoEConfig, is_expert_param

D, F_EXPERT = 8, 6


def make_layer(cfg: MoEConfig, gated: bool, shared: bool = False, impl: str = "loop", seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    mlp = llama.SwiGLU(D, 5) if gated else gpt.MLP(D, 5)
    layer = MoE(D, cfg, gated=gated, shared=mlp if shared else None, impl=impl).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
        layer.router.expert_bias.normal_(0, 0.3)
    return layer


def expert_out(layer: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    h = x @ ex.w1[e]
    h = F.silu(h) * (x @ ex.w3[e]) if ex.gated else F.gelu(h, approximate="tanh")
    return h @ ex.w2[e]


def allowed(cfg: MoEConfig, pick: torch.Tensor) -> list[int]:
    """The experts of one token's ``groups_per_token`` best groups, a group scored by its best two picks."""
    size = cfg.n_experts // cfg.expert_groups
    groups = [range(g * size, (g + 1) * size) for g in range(cfg.expert_groups)]
    best = sorted(groups, key=lambda group: -sum(sorted((pick[e].item() for e in group), reverse=True)[:2]))
    return [e for group in best[: cfg.groups_per_token] for e in group]


def reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, weighted aux terms and copies per expert, token by token and sequence by sequence."""
    cfg = layer.cfg
    batch, seq, _ = x.shape
    flat = x.reshape(-1, D)
    capacity = cfg.capacity(flat.shape[0]) if not cfg.dropless else math.inf
    taken = [0] * cfg.n_experts
    outs, aux, lse = [], 0.0, []
    chosen_per_seq = torch.zeros(batch, cfg.n_experts, dtype=torch.float64)
    probs_per_seq = torch.zeros(batch, cfg.n_experts, dtype=torch.float64)
    for t in range(flat.shape[0]):
        logits = layer.router.gate.weight @ flat[t]
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        pick = scores + layer.router.expert_bias  # the selection bias, whether training moves it or not
        top = sorted(allowed(cfg, pick), key=lambda e: -pick[e].item())[: cfg.top_k]
        w = scores[top]
        if cfg.normalize_top_k or cfg.score == "sigmoid":
            w = w / w.sum()
        y = torch.zeros(D, dtype=torch.float64)
        for j, e in enumerate(sorted(top)):
            weight = w[top.index(e)]
            if taken[e] < capacity:
                y = y + weight * expert_out(layer, e, flat[t : t + 1])[0]
            taken[e] += 1
        if layer.shared is not None:
            y = y + layer.shared(flat[t : t + 1])[0]
        outs.append(y)
        s = t // seq
        chosen_per_seq[s, top] += 1
        probs_per_seq[s] = probs_per_seq[s] + (scores if cfg.score == "softmax" else scores / scores.sum())
        lse.append(torch.logsumexp(logits, -1) ** 2)
    for s in range(batch):
        f = chosen_per_seq[s] * cfg.n_experts / (cfg.top_k * seq)
        aux = aux + (f * probs_per_seq[s] / seq).sum() / batch
    z = torch.stack(lse).mean()
    return torch.stack(outs).view_as(x), cfg.aux_coef * aux + cfg.z_coef * z, chosen_per_seq.sum(0)


VARIANTS = {
    "softmax top2 gelu": (MoEConfig(4, 2, F_EXPERT, aux_coef=0.1, z_coef=0.01, normalize_top_k=False), False, False),
    "softmax top2 swiglu shared": (MoEConfig(4, 2, F_EXPERT, n_shared_experts=1, aux_coef=0.1, z_coef=0.01),
                                   True, True),
    "sigmoid top3 bias": (MoEConfig(5, 3, F_EXPERT, score="sigmoid", aux_coef=0.05, z_coef=0.02, bias_rate=0.1),
                          True, False),
    "capacity 0.75": (MoEConfig(4, 2, F_EXPERT, capacity_factor=0.75, aux_coef=0.1), False, False),
    # DeepSeek-V3's routing: 3 of 12 experts from the best 2 of 4 groups of 3, each scored by its best two.
    "sigmoid top3 in 2 of 4 groups": (MoEConfig(12, 3, F_EXPERT, score="sigmoid", aux_coef=0.05, bias_rate=0.1,
                                                expert_groups=4, groups_per_token=2), True, True),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_layer_matches_a_token_by_token_reference_in_fp64(name: str) -> None:
    cfg, gated, shared = VARIANTS[name]
    layer = make_layer(cfg, gated, shared)
    x = torch.randn(3, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(3, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = layer(x)
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad()
    x.grad = None
    ref, aux, chosen = reference(layer, x)
    ((ref * g).sum() + aux).backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for n, p in [*layer.named_parameters(), ("x", x)]:
        torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-12, msg=f"{name}: grad of {n}")
    s = layer.stats
    assert torch.equal(s.counts, chosen.long())  # what the bias update reads: the experts actually chosen
    assert s.routed == 15 * cfg.top_k and s.counts.sum() == s.routed and s.forwards == 1
    expected_dropped = 0 if cfg.dropless else int((s.counts - s.counts.clamp(max=cfg.capacity(15))).sum())
    assert s.dropped == expected_dropped and (s.dropped > 0) == (not cfg.dropless)


def test_padded_batched_gemm_equals_the_loop_over_experts_including_empty_experts() -> None:
    cfg = MoEConfig(6, 2, F_EXPERT)
    loop, padded = make_layer(cfg, True), make_layer(cfg, True, impl="padded")
    x = torch.randn(9, D, dtype=torch.float64, requires_grad=True)
    counts = torch.tensor([3, 0, 4, 0, 2, 0])
    outs = []
    for layer in (loop, padded):
        y = layer.experts(x, counts)
        y.square().sum().backward()
        outs.append((y, x.grad.clone(), layer.experts.w1.grad.clone(), layer.experts.w2.grad.clone()))
        x.grad = None
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-14)
    assert outs[0][2][1].abs().max() == 0  # an expert with no tokens gets no gradient


def test_balance_and_z_loss_by_hand() -> None:
    # one sequence of 2 tokens, 2 experts, top-1: both tokens go to expert 0.
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64)
    experts = torch.tensor([[0], [0]])
    # f = E/(kT) * count = [2/2*2, 0] = [2, 0]; P = [0.625, 0.375]; sum f P = 1.25
    assert moe.balance_loss(experts, probs, 1, 2, 1).item() == pytest.approx(1.25, abs=1e-15)
    # two sequences, one token each: seq 0 -> expert 0, seq 1 -> expert 1; f = [2, 0] and [0, 2]
    # seq0: 2 * 0.75 = 1.5; seq1: 2 * 0.5 = 1.0; mean 1.25 (not the batch-wide 1.0 + ...)
    assert moe.balance_loss(torch.tensor([[0], [1]]), probs, 2, 2, 1).item() == pytest.approx(1.25, abs=1e-15)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], dtype=torch.float64)
    # logsumexp: log 2 and log 4; mean of squares
    assert moe.z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2, abs=1e-15)


def test_bias_update_moves_against_the_load_error() -> None:
    layer = make_layer(MoEConfig(4, 1, F_EXPERT, bias_rate=0.5), False)
    layer.router.expert_bias.zero_()
    layer.stats.counts = torch.tensor([5, 1, 2, 0])
    moe.update_expert_bias(layer)
    assert layer.router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.5]  # mean load 2


def test_aux_grad_scale_scales_only_the_aux_gradient() -> None:
    cfg = MoEConfig(4, 2, F_EXPERT, aux_coef=0.3, z_coef=0.1)
    layer = make_layer(cfg, False)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    grads = []
    for scale in (1.0, 0.0, 3.0):
        moe.begin_step(layer, scale)
        layer(x).sum().backward()
        grads.append(layer.router.gate.weight.grad.clone())
        layer.zero_grad()
    torch.testing.assert_close(grads[2] - grads[1], 3 * (grads[0] - grads[1]), rtol=1e-12, atol=1e-14)
    assert (grads[0] - grads[1]).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["moe-tiny", "llama-moe-tiny"])
def test_presets_build_with_expert_params_marked_and_counted(name: str) -> None:
    spec = spec_of(name)
    cfg = spec.presets[name]
    model = spec.builder(cfg, 0)
    params = dict(model.named_parameters())
    assert sum(p.numel() for p in params.values()) == cfg.n_params() == spec.shape(cfg).n_params()
    experts = {n for n, p in params.items() if is_expert_param(p)}
    assert experts and all(".mlp.experts.w" in n for n in experts)
    assert all(".mlp.experts." not in n for n in params.keys() - experts)
    logits = model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size)


def test_dense_leading_layers_keep_their_mlp() -> None:
    cfg = llama.LlamaConfig(3, 16, 2, 1, 24, 32, 8, moe=MoEConfig(4, 2, 8, n_dense_layers=2))
    model = llama.Llama(cfg)
    kinds = [type(b.mlp).__name__ for b in model.blocks.values()]
    assert kinds == ["SwiGLU", "SwiGLU", "MoE"]
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()


def test_top_k_above_the_expert_count_is_refused() -> None:
    with pytest.raises(ValueError, match="top_k=3 experts per token out of n_experts=2; choose top_k in 1..2"):
        MoEConfig(2, 3, 4)


def test_group_limited_routing_changes_the_choice_and_keeps_it_in_the_best_groups() -> None:
    """Each token's experts lie in its 2 best of 4 groups, and on this input some token's differ from the
    unlimited choice (so the reference comparison above would fail without the grouping)."""
    cfg = VARIANTS["sigmoid top3 in 2 of 4 groups"][0]
    layer = make_layer(cfg, True)
    x = torch.randn(15, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grouped = layer.router(x)[0]
    layer.router.cfg = dataclasses.replace(cfg, groups_per_token=4)
    unlimited = layer.router(x)[0]
    assert (grouped.sort(-1).values != unlimited.sort(-1).values).any(-1).sum() >= 1
    assert all((g // 3).unique().numel() <= 2 for g in grouped)


@pytest.mark.parametrize("fields,message", [
    (dict(expert_groups=5), r"expert_groups=5 does not divide n_experts=12; choose expert_groups in "
                            r"\[1, 2, 3, 4, 6, 12\]"),
    (dict(expert_groups=4, groups_per_token=5), "groups_per_token=5 of expert_groups=4; choose groups_per_token in "
                                                "1..4"),
    (dict(expert_groups=4, groups_per_token=1), "top_k=4 experts per token, but its groups_per_token=1 groups of 3 "
                                                "experts hold only 3; lower top_k or raise groups_per_token"),
])
def test_expert_groups_that_cannot_route_are_refused_in_one_line(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoEConfig(12, 4, 4, **fields)
