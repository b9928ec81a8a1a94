"""ZeRO stage 3, P_os+g+p (§5.3): parameters, too, are kept as 1/N shards. Each unit
(:func:`default_units`) is gathered before its forward and its backward, freed after, the next one
prefetched; gradients are reduce-scattered once complete: 1.5x DP's communication."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from trainmesh.distributed.comm import Comm
from trainmesh.training.optim import OptimizerFactory
from trainmesh.parallel.expert_parallel import reduction_axis, with_expert_units
from trainmesh.parallel.zero import flat
from trainmesh.parallel.zero.base import DEFAULT_BUCKET_BYTES, trainable
from trainmesh.parallel.zero.flat import Group, sharded_group
from trainmesh.parallel.zero.stage2 import ZeroStage2
from trainmesh.training.precision import LossScaler


def default_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stage-3 wrapping policy: each top-level child a unit, each block of a ModuleDict/ModuleList its own,
    in registration order (the prefetch's forward order)."""
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            units += [(f"{name}.{sub}", c) for sub, c in child.named_children()]
        else:
            units.append((name, child))
    units = [(name, m) for name, m in units if trainable(m)]
    _check_units_cover(model, units)
    return units


def _check_units_cover(model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """Refuse units that leave a trainable parameter out: it would be neither sharded nor reduced. (A parameter
    two units share, a tied embedding's, is the later one's: :func:`own_params`, :func:`lenders`.)"""
    owner = {id(p) for _, module in units for p in module.parameters()}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        raise ValueError(f"parameters {missing} belong to no ZeRO-3 unit; move them into a submodule "
                         f"or pass units that include the module holding them")


def own_params(units: list[tuple[str, nn.Module]]) -> list[list[nn.Parameter]]:
    """Each unit's trainable parameters less those of a unit listed after it (the routed experts of a block,
    :func:`trainmesh.parallel.expert_parallel.with_expert_units`; the head a tied embedding shares its weight with),
    so every parameter is in one unit."""
    owner = {id(p): k for k, (_, m) in enumerate(units) for p in trainable(m)}
    return [[p for p in trainable(m) if owner[id(p)] == k] for k, (_, m) in enumerate(units)]


def lenders(units: list[tuple[str, nn.Module]], owned: list[list[nn.Parameter]]) -> list[list[int]]:
    """For each unit, the other units owning a parameter it uses from outside its own submodules (a tied
    embedding's weight, owned by the head): its forward needs them gathered too."""
    owner = {id(p): k for k, params in enumerate(owned) for p in params}
    inside = [{id(p) for c in m.children() for p in c.parameters()} for _, m in units]
    return [list(dict.fromkeys(owner[id(p)] for p in trainable(m) if owner[id(p)] != k and id(p) not in inside[k]))
            for k, (_, m) in enumerate(units)]


def _grad_tensors(values: object) -> list[torch.Tensor]:
    """The tensors among a module's inputs or output that backward will reach."""
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]


def _when_backward_reaches(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn`` (once per tensor) as backward reaches the nodes that made ``tensors``; a node pre-hook runs after
    the tensor hooks, so the next unit is freed before this one is gathered: two units at a time, not three."""
    for t in tensors:
        if t.grad_fn is not None:
            t.grad_fn.register_prehook(lambda grads: fn())
        else:
            t.register_hook(lambda grad: fn())


def _when_all_have_grads(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn`` once every one of ``tensors`` has its gradient (``register_multi_grad_hook(mode="all")`` refuses
    the leaf input of ``torch.autograd.grad`` a pipeline stage receives)."""
    left = [len(tensors)]

    def hook(_grad: torch.Tensor) -> None:
        left[0] -= 1
        if left[0] == 0:
            fn()

    for t in tensors:
        t.register_hook(hook)


@dataclass
class Unit:
    """A stage-3 wrapping unit: a module whose parameters are gathered and freed together."""

    name: str
    module: nn.Module
    group: Group
    order: int
    gather_work: object | None = None
    grad_elements: int = 0  # of this backward's gradients in so far

    @property
    def gathered(self) -> bool:
        """Whether the full parameters are allocated (gathered, or a gather is in flight)."""
        return self.group.flat.untyped_storage().nbytes() > 0


class ZeroStage3(ZeroStage2):
    """P_os+g+p (§5.3): parameters sharded too; hooks gather each unit for its forward and its backward, prefetching the
    next, and free it and reduce-scatter its gradients once all are in, in an order set by the model alone. Zero bubble
    gathers a unit three times per micro-batch (4Ψ(N-1)/N), the weight pass through :meth:`unshard_for_backward`."""

    def __init__(self, module: nn.Module, comm: Comm, make_optimizer: OptimizerFactory,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 scaler: LossScaler | None = None, axis: str = "dp",
                 units: list[tuple[str, nn.Module]] | None = None) -> None:
        units = with_expert_units(units if units is not None else default_units(module), module)
        owned = own_params(units)
        holding = [k for k, params in enumerate(owned) if params]  # a tied embedding's unit may own nothing
        self.units = [Unit(units[k][0], units[k][1], sharded_group(units[k][0], owned[k], comm,
                                                                   reduction_axis(owned[k][0], axis), reduce_dtype,
                                                                   own_shard=True), order)
                      for order, k in enumerate(holding)]
        groups = [u.group for u in reversed(self.units)]
        super().__init__(module, comm, make_optimizer, bucket_bytes, reduce_dtype, scaler, axis, groups)
        self._unit_of = {u.group.name: u for u in self.units}
        unit_at = dict(zip(holding, self.units))
        for k, ((_, m), lent) in enumerate(zip(units, lenders(units, owned))):
            for unit in ([unit_at[k]] if k in unit_at else []) + [unit_at[j] for j in lent]:
                m.register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u))
                m.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, args, out))
        for unit in self.units:
            self._reshard(unit)

    def _unshard(self, unit: Unit, op: str) -> None:
        """Allocate the unit's full buffer and start gathering every rank's shard into it."""
        if unit.gathered:
            return
        full = unit.group.flat
        full.untyped_storage().resize_(full.numel() * full.element_size())
        unit.gather_work = flat.gather_shards(self.comm, full, unit.group.shard, unit.group.axis, op)
        self.events.append(("gather", unit.name, op))
        self._note_peak()

    def _wait_gathered(self, unit: Unit) -> None:
        if unit.gather_work is not None:
            unit.gather_work.wait()
            unit.gather_work = None

    def _reshard(self, unit: Unit) -> None:
        """Free the unit's full parameters (after any gather into them has finished)."""
        self._wait_gathered(unit)
        if unit.gathered:
            self.events.append(("free", unit.name))
        unit.group.flat.untyped_storage().resize_(0)

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        k = unit.order + step
        return self.units[k] if 0 <= k < len(self.units) else None

    def _gather_now_and_prefetch(self, unit: Unit, step: int, op: str) -> None:
        self._unshard(unit, op)
        self._wait_gathered(unit)
        following = self._neighbour(unit, step)
        if following is not None:
            self._unshard(following, op)

    def _pre_forward(self, unit: Unit) -> None:
        self._gather_now_and_prefetch(unit, +1, "fwd_param_all_gather")

    def _post_forward(self, unit: Unit, inputs: tuple, output: object) -> None:
        self._reshard(unit)
        self.events.append(("forward", unit.name))
        if not torch.is_grad_enabled():
            return
        outputs, inputs = _grad_tensors(output), _grad_tensors(inputs)
        if outputs:
            _when_backward_reaches(outputs, lambda u=unit: self._pre_backward(u))
        if inputs:
            _when_all_have_grads(inputs, lambda u=unit: self._post_backward_inputs(u))

    def _pre_backward(self, unit: Unit) -> None:
        """Gather the unit for its backward. The unit before it is prefetched once half of this unit's
        gradient has come in (:meth:`_on_grad_ready`), except in an input-only pass, which computes none."""
        self._queue_end_of_backward()
        if self._input_only:
            self._gather_now_and_prefetch(unit, -1, "bwd_param_all_gather")
        else:
            self._unshard(unit, "bwd_param_all_gather")
            self._wait_gathered(unit)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Stage 2's handling, then the backward prefetch once half the unit's gradient elements are in: by then
        its freed activations exceed the prefetch's buffer, and the gather still overlaps the other half."""
        unit = self._unit_of[self._slot[p][0].name]
        unit.grad_elements += p.numel()
        following = self._neighbour(unit, -1)
        if following is not None and 2 * unit.grad_elements >= unit.group.layout.numel:
            self._unshard(following, "bwd_param_all_gather")
        super()._on_grad_ready(p)

    def _post_backward_inputs(self, unit: Unit) -> None:
        """The gradient has gone through the unit to its inputs. An input-only pass needs the unit no more
        (a full backward frees it when its parameters' gradients are in)."""
        if self._input_only:
            self._reshard(unit)

    def unshard_for_backward(self, params: Sequence[nn.Parameter]) -> None:
        """Gather the unit(s) holding ``params`` for an autograd call starting inside them, prefetching the unit
        before; each is freed once its gradients are in or the backward pass ends."""
        for name in dict.fromkeys(self._slot[p][0].name for p in params):
            self._gather_now_and_prefetch(self._unit_of[name], -1, "bwd_param_all_gather")

    def _on_group_ready(self, group: Group) -> None:
        unit = self._unit_of[group.name]
        unit.grad_elements = 0
        self._reshard(unit)

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        for unit in self.units:
            unit.grad_elements = 0
            self._reshard(unit)

    def after_update(self) -> None:
        """Nothing to gather: the next forward gathers each unit from its updated shard."""

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold every unit's full parameters, e.g. to export ``module.state_dict()``; freed on exit. A collective:
        every dp rank must enter it."""
        for unit in self.units:
            self._unshard(unit, "state_dict_all_gather")
        try:
            for unit in self.units:
                self._wait_gathered(unit)
            yield
        finally:
            for unit in self.units:
                self._reshard(unit)

