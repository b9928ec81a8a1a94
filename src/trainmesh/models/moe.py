"""A mixture-of-experts layer in place of a block's MLP, knowing nothing of parallelism.

Each token goes to ``top_k`` of ``n_experts`` expert MLPs picked by a router (Shazeer et al., 2017; GShard; Switch),
plus shared experts (DeepSeekMoE, Dai et al., 2024); a :class:`Dispatcher` moves the expert-sorted copies. Balancing:
the per-sequence aux loss (DeepSeek-V3 eq. 17-20), the z-loss (ST-MoE, Zoph et al., 2022, eq. 5) and the aux-loss-free
bias (Wang et al., 2024; DeepSeek-V3 §2.1.2), the aux terms entering backward via :class:`InjectAuxGrad`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.models.spec import divisors

EXPERT_PARAM = "_trainmesh_expert"
"""The attribute :class:`GroupedExperts` sets on its parameters (see :func:`is_expert_param`)."""

SCORES = ("softmax", "sigmoid")
IMPLS = ("loop", "padded")
GPT_OSS_ALPHA = 1.702  # the sigmoid's slope in GPT-OSS's clamped SwiGLU (its swiglu_alpha)


def is_expert_param(p: torch.Tensor) -> bool:
    """True for a routed expert's weight (first dimension: the local experts), sharded over ``ep`` and reduced over
    the edp group only; False for the router, shared experts and every other parameter."""
    return bool(getattr(p, EXPERT_PARAM, False))


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's routing and balancing: ``softmax`` (Mixtral) or ``sigmoid`` (DeepSeek-V3) scores;
    ``capacity_factor`` 0 dropless, else ceil(cf * tokens * top_k / E) copies per expert; DeepSeek-V3's scaling and
    group limits (§2.1.2); GPT-OSS's ``biases`` (router and experts) and clamped SwiGLU (``swiglu_limit`` > 0)."""

    n_experts: int
    top_k: int
    d_ff_expert: int
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    score: str = "softmax"
    normalize_top_k: bool = True
    capacity_factor: float = 0.0
    aux_coef: float = 0.01
    z_coef: float = 0.0
    bias_rate: float = 0.0
    route_scale: float = 1.0
    expert_groups: int = 1
    groups_per_token: int = 1
    biases: bool = False
    swiglu_limit: float = 0.0

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What makes this configuration unusable, in one line with the fix; None if nothing does."""
        if self.n_experts < 1:
            return f"n_experts={self.n_experts}; an MoE layer needs at least one expert"
        if not 1 <= self.top_k <= self.n_experts:
            return (f"top_k={self.top_k} experts per token out of n_experts={self.n_experts}; choose top_k in "
                    f"1..{self.n_experts}")
        if self.score not in SCORES:
            return f"router score {self.score!r}; choose one of {', '.join(SCORES)}"
        if self.capacity_factor < 0 or self.aux_coef < 0 or self.z_coef < 0 or self.bias_rate < 0:
            return "capacity_factor, aux_coef, z_coef and bias_rate must be at least 0"
        return self._group_problem()

    def _group_problem(self) -> str | None:
        groups, picked = self.expert_groups, self.groups_per_token
        if groups < 1 or self.n_experts % groups:
            return (f"expert_groups={groups} does not divide n_experts={self.n_experts}; choose expert_groups in "
                    f"{divisors(self.n_experts)}")
        if not 1 <= picked <= groups:
            return f"groups_per_token={picked} of expert_groups={groups}; choose groups_per_token in 1..{groups}"
        if self.top_k > picked * (self.n_experts // groups):
            return (f"top_k={self.top_k} experts per token, but its groups_per_token={picked} groups of "
                    f"{self.n_experts // groups} experts hold only {picked * (self.n_experts // groups)}; lower "
                    f"top_k or raise groups_per_token")
        return None

    @property
    def group_limited(self) -> bool:
        """True when a token may not pick from every group (:func:`limit_to_groups` applies)."""
        return self.groups_per_token < self.expert_groups

    def shape_fields(self) -> dict[str, int]:
        """The planner's :class:`~trainmesh.models.spec.ModelShape` fields of these experts (its ``expert_groups``
        0 when routing is not group-limited)."""
        fields = dict(n_experts=self.n_experts, top_k=self.top_k, n_shared_experts=self.n_shared_experts,
                      d_ff_expert=self.d_ff_expert, n_dense_layers=self.n_dense_layers)
        if self.group_limited:
            fields.update(expert_groups=self.expert_groups, groups_per_token=self.groups_per_token)
        return fields

    @property
    def dropless(self) -> bool:
        return self.capacity_factor == 0

    def capacity(self, tokens: int) -> int:
        """Token copies one expert takes from ``tokens`` tokens (GShard's expert capacity)."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)


def mark_experts(module: nn.Module) -> None:
    for p in module.parameters():
        setattr(p, EXPERT_PARAM, True)


def padded_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows ``x`` (grouped by expert, ``counts[e]`` rows for expert ``e``) times their expert's ``w[e]`` as one
    batched GEMM over ``[E, max(counts), d]``: one kernel whatever E, at the price of the padding rows."""
    width = max(counts, default=0)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device))
    starts = torch.tensor([0, *counts[:-1]], device=x.device).cumsum(0)
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(len(counts), width, x.shape[1]).index_put((expert, slot), x)
    return torch.bmm(padded, w)[expert, slot]


def looped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same product as :func:`padded_matmul`, one GEMM per expert on its contiguous slice."""
    pieces = [part @ w[e] for e, part in enumerate(x.split(counts))]
    return torch.cat(pieces) if pieces else x.new_zeros(0, w.shape[-1])


MATMULS: dict[str, Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]] = {
    "loop": looped_matmul, "padded": padded_matmul}
"""torch 2.13's ``torch.nn.functional.grouped_mm`` is no choice on CPU: it refuses float64 and its
backward fails there, so the grouped products are a loop over slices or a padded batched GEMM."""


class GroupedExperts(nn.Module):
    """``E_local`` expert MLPs held as stacked weights: ``w1`` ``[E, d, f]``, ``w3`` ``[E, d, f]`` (gated only),
    ``w2`` ``[E, f, d]``, with ``bias`` their biases ``b1``, ``b3`` ``[E, f]`` and ``b2`` ``[E, d]``; ``limit`` > 0:
    GPT-OSS's clamped SwiGLU. ``forward`` takes token copies sorted by expert with their counts, so expert
    parallelism can hand it any contiguous subset of experts (every parameter is split on its first dim).
    ``adds_down_bias`` False: this process's output is a partial sum that another's adds ``b2`` to (expert tensor
    parallelism); ``b2`` then adds zero yet takes its gradient, so every copy of it learns alike."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, gated: bool, impl: str = "loop", bias: bool = False,
                 limit: float = 0.0) -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"expert matmul {impl!r}; choose one of {', '.join(IMPLS)}")
        self.gated, self.impl, self.limit, self.adds_down_bias = gated, impl, limit, True
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, d_ff)) if gated else None
        self.w2 = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        if bias:
            self.b1, self.b2 = nn.Parameter(torch.zeros(n_experts, d_ff)), nn.Parameter(torch.zeros(n_experts, d_model))
            self.b3 = nn.Parameter(torch.zeros(n_experts, d_ff)) if gated else None
        self.reset_parameters()
        mark_experts(self)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear`` initialises its weight: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        (the model families re-initialise them with their own scheme)."""
        for w in (self.w1, self.w3, self.w2):
            if w is not None:
                bound = 1 / math.sqrt(w.shape[1])
                w.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes, matmul = counts.tolist(), MATMULS[self.impl]
        rows = torch.repeat_interleave(torch.arange(len(sizes), device=x.device), counts.to(x.device))

        def project(h: torch.Tensor, w: torch.Tensor, bias: str) -> torch.Tensor:
            y = matmul(h, w, sizes)
            if not hasattr(self, "b1"):
                return y
            b = getattr(self, bias)
            return y + (b if bias != "b2" or self.adds_down_bias else b - b.detach())[rows]

        gate = project(x, self.w1, "b1")
        if self.gated and self.limit:  # GPT-OSS: gate clamped above, up both ways, gate σ(1.702 gate) (up + 1)
            gate, up = gate.clamp(max=self.limit), project(x, self.w3, "b3").clamp(-self.limit, self.limit) + 1
            h = gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * up
        else:
            h = F.silu(gate) * project(x, self.w3, "b3") if self.gated else F.gelu(gate, approximate="tanh")
        return project(h, self.w2, "b2")


def limit_to_groups(choice: torch.Tensor, groups: int, kept: int) -> torch.Tensor:
    """``choice`` ``[T, E]`` with every expert outside each token's ``kept`` best of ``groups`` equal groups set
    to -inf, a group scored by the sum of its two best experts' choice scores (DeepSeek-V3's node-limited
    routing, §2.1.2, as transformers' ``DeepseekV3TopkRouter`` computes it)."""
    by_group = choice.view(choice.shape[0], groups, -1)
    group_score = by_group.topk(min(2, by_group.shape[-1]), dim=-1).values.sum(-1)
    best = group_score.topk(kept, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return by_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


class Router(nn.Module):
    """Scores every expert per token and picks ``top_k``; the ``expert_bias`` buffer shifts the choice only
    (DeepSeek-V3 eq. 16). Expert parallelism swaps only the dispatcher, so every layout routes alike."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(d_model, cfg.n_experts, bias=cfg.biases)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[T, d]`` -> (chosen experts ``[T, k]``, their weights ``[T, k]``, each token's scores normalised
        over all experts ``[T, E]`` (the P of the balance loss), logits ``[T, E]``), in at least float32."""
        logits = self.gate(x).to(torch.promote_types(x.dtype, torch.float32))
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        choice = (scores + self.expert_bias.to(scores.dtype)).detach()  # the bias is 0 unless moved or imported
        if self.cfg.group_limited:
            choice = limit_to_groups(choice, self.cfg.expert_groups, self.cfg.groups_per_token)
        experts = choice.topk(self.cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, experts)
        if self.cfg.normalize_top_k or self.cfg.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        if self.cfg.route_scale != 1.0:
            weights = weights * self.cfg.route_scale
        probs = scores if self.cfg.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return experts, weights, probs, logits

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """Move each expert's bias by ``bias_rate`` towards the mean load: up if it took fewer tokens than
        the mean of ``counts`` (``[E]``, over the whole global batch), down if more."""
        mean = counts.double().mean()
        self.expert_bias += self.cfg.bias_rate * torch.sign(mean - counts.double()).to(self.expert_bias.dtype)


class Dispatcher(Protocol):
    """Moves sorted token copies to the processes holding their experts and back (see MOE_INTERFACE)."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``x`` ``[N, d]`` sorted by global expert, ``counts`` ``[E]`` -> this rank's experts' copies sorted
        by local expert, their counts ``[E_local]``, and a handle for :meth:`combine`."""

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """The inverse of :meth:`dispatch`: ``[N, d]`` in the order of dispatch's ``x``."""


class LocalDispatch:
    """Every expert is on this process: dispatch and combine are the identity."""

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return x, counts, None

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        return y


class InjectAuxGrad(torch.autograd.Function):
    """Forward ``output`` unchanged; backward ``scale`` as the gradient of scalar ``aux`` (Megatron-core's
    MoEAuxLossAutoScaler), so the aux loss back-propagates with the main loss without being added to it."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_dtype = aux.dtype
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def balance_loss(experts: torch.Tensor, probs: torch.Tensor, batch: int, n_experts: int, top_k: int,
                 split: "SequenceSplit | None" = None) -> torch.Tensor:
    """Mean over the ``batch`` sequences of ``sum_i f_i P_i`` (DeepSeek-V3 eq. 17-20 without the coefficient):
    1 for even routing, E at collapse. With ``split``, per-sequence sums are taken over all its shards."""
    chosen = F.one_hot(experts, n_experts).sum(1).to(probs.dtype).view(batch, -1, n_experts)
    tokens = chosen.shape[1]
    routed, scored = chosen.sum(1), probs.view(batch, tokens, n_experts).sum(1)
    if split is not None:
        routed, scored, tokens = split.total(routed).detach(), split.total(scored), tokens * split.shards
    f = routed * (n_experts / (top_k * tokens))
    return (f * scored / tokens).sum(-1).mean()


@dataclass(frozen=True)
class SequenceSplit:
    """Every sequence split over ``shards`` processes (sp or cp): ``total`` sums per-sequence statistics over them
    (backward: each its own tokens' part); ``total_counts`` sums expert counts without counting a token twice."""

    shards: int
    total: Callable[[torch.Tensor], torch.Tensor]
    total_counts: Callable[[torch.Tensor], torch.Tensor]


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of the squared log-partition of the router logits."""
    return torch.logsumexp(logits, dim=-1).square().mean()


@dataclass
class MoEStats:
    """What one layer saw since :func:`begin_step`: copies routed to each expert (before any drop), copies
    dropped, copies routed, and the (unweighted) aux and z losses summed over forwards."""

    counts: torch.Tensor
    dropped: int = 0
    routed: int = 0
    aux_loss: float = 0.0
    z_loss: float = 0.0
    forwards: int = 0


def _recomputing() -> bool:
    """True inside backward (activation recomputation re-running a forward), which must not count twice."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The MoE layer: ``[B, S, d]`` -> ``[B, S, d]``, a drop-in for a block's MLP. ``gated``: SwiGLU experts,
    else GELU; ``shared``: the shared experts' MLP or None; ``impl``: one of :data:`MATMULS`;
    ``aux_grad_scale``: the aux losses' gradient per forward (set by :func:`begin_step`)."""

    def __init__(self, d_model: int, cfg: MoEConfig, gated: bool, shared: nn.Module | None = None,
                 impl: str = "loop") -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(d_model, cfg)
        self.experts = GroupedExperts(cfg.n_experts, d_model, cfg.d_ff_expert, gated, impl, cfg.biases, cfg.swiglu_limit)
        self.shared = shared
        self.dispatcher: Dispatcher = LocalDispatch()
        self.aux_grad_scale = 1.0
        self.split: SequenceSplit | None = None  # set by a parallel form that splits sequences
        self.stats = MoEStats(torch.zeros(cfg.n_experts, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, shape = x.shape[0], x.shape
        flat = x.reshape(-1, shape[-1])
        experts, weights, probs, logits = self.router(flat)
        counts = torch.bincount(experts.reshape(-1), minlength=self.cfg.n_experts)
        order = experts.reshape(-1).argsort(stable=True)
        kept_counts, keep = counts, None
        if not self.cfg.dropless:
            kept_counts, keep = self._capacity_mask(counts, flat.shape[0])
            order_kept = order[keep]
        else:
            order_kept = order
        copies = flat[order_kept // self.cfg.top_k]
        local, local_counts, handle = self.dispatcher.dispatch(copies, kept_counts)
        y = self.dispatcher.combine(self.experts(local, local_counts), handle)
        full = y.new_zeros(experts.numel(), shape[-1]).index_copy(0, order_kept, y)
        out = (full.view(*experts.shape, -1) * weights.to(y.dtype).unsqueeze(-1)).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        out = self._with_aux_losses(out, experts, probs, logits, batch, counts, kept_counts)
        return out.view(shape)

    def _capacity_mask(self, counts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts after dropping and which sorted copies survive: the first ``capacity`` of each expert."""
        capacity = self.cfg.capacity(tokens)
        starts = counts.cumsum(0) - counts
        expert_sorted = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        slot = torch.arange(int(counts.sum()), device=counts.device) - starts[expert_sorted]
        return counts.clamp(max=capacity), slot < capacity

    def _with_aux_losses(self, out: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor,
                         batch: int, counts: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """``out`` carrying the aux losses' gradients; records this forward's statistics."""
        cfg = self.cfg
        aux = balance_loss(experts, probs, batch, cfg.n_experts, cfg.top_k, self.split)
        z = z_loss(logits) if self.split is None else self.split.total(z_loss(logits)) / self.split.shards
        if torch.is_grad_enabled() and not _recomputing():
            if self.split is not None:
                counts, kept = self.split.total_counts(counts), self.split.total_counts(kept)
            s = self.stats
            s.counts = s.counts.to(counts.device) + counts.detach()
            s.routed += int(counts.sum())
            s.dropped += int(counts.sum() - kept.sum())
            s.aux_loss += aux.item()
            s.z_loss += z.item()
            s.forwards += 1
        total = cfg.aux_coef * aux + cfg.z_coef * z
        if torch.is_grad_enabled() and total.requires_grad:
            out = InjectAuxGrad.apply(out, total, self.aux_grad_scale)
        return out

    def aux_total(self) -> float:
        """This layer's weighted aux terms summed over the forwards since :func:`begin_step`."""
        return self.cfg.aux_coef * self.stats.aux_loss + self.cfg.z_coef * self.stats.z_loss


def layer_mlp(d_model: int, d_ff: int, cfg: MoEConfig | None, layer: int,
              dense: Callable[[int, int], nn.Module], gated: bool) -> nn.Module:
    """Layer ``layer``'s MLP in a family whose dense MLP is ``dense(d_model, width)``: that MLP, or (an MoE model past
    its dense layers) experts of the same kind, with the shared experts as one ``dense`` of their summed width."""
    if cfg is None or layer < cfg.n_dense_layers:
        return dense(d_model, d_ff)
    shared = dense(d_model, cfg.n_shared_experts * cfg.d_ff_expert) if cfg.n_shared_experts else None
    return MoE(d_model, cfg, gated=gated, shared=shared)


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """Every MoE layer of ``model`` with its module name."""
    return ((name, m) for name, m in model.named_modules() if isinstance(m, MoE))


def begin_step(model: nn.Module, aux_grad_scale: float) -> None:
    """Start a step: clear every layer's statistics and set the gradient its aux losses get per forward (the factor
    the main loss of one micro-batch is multiplied by before backward: loss scale divided by the micro-batch count)."""
    for _, layer in moe_layers(model):
        layer.stats = MoEStats(torch.zeros_like(layer.stats.counts))
        layer.aux_grad_scale = aux_grad_scale


def aux_loss_total(model: nn.Module) -> float:
    """The weighted aux losses of every layer, summed over layers, over the forwards since
    :func:`begin_step` (the caller divides by the micro-batch count, as for the main loss)."""
    return sum(layer.aux_total() for _, layer in moe_layers(model))


def update_expert_bias(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """The aux-loss-free bias update of every layer with a ``bias_rate`` from this step's expert counts, ``reduce``
    summing the ``[layers, E]`` counts over processes that saw other tokens. Call after the optimizer step."""
    layers = [layer for _, layer in moe_layers(model) if layer.cfg.bias_rate]
    if not layers:
        return
    counts = reduce(torch.stack([layer.stats.counts for layer in layers]))
    for layer, row in zip(layers, counts):
        layer.router.update_bias(row)


__all__ = ["MoE", "MoEConfig", "Router", "GroupedExperts", "Dispatcher", "LocalDispatch", "is_expert_param",
           "layer_mlp", "begin_step", "aux_loss_total", "update_expert_bias", "moe_layers", "balance_loss", "z_loss",
           "SequenceSplit", "limit_to_groups"]
