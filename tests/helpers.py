"""What the equivalence tests share: train in this process as the single-process reference, train on N
ranks, and compare per-step losses and final parameters.

Equivalence is proven in float64. A layout changes only the order in which sums are taken (a gradient
reduced over ranks, a loss split over micro-batches or vocabulary shards); in float64 each such sum is
off by at most about n·u·Σ|x| with u = 1.1e-16, and ten steps of AdamW can amplify a gradient difference δ
into at most lr·δ/eps = 3e-3·δ/1e-8 per parameter. With δ ~ 1e-13 that is 3e-8 in the worst case and
~1e-14 in practice (measured: |Δloss| 9e-16, |Δparam| 5e-15 at DP=2), so :data:`FP64_ATOL` = 1e-9 leaves
five orders of magnitude for a machine's summation order and none for a real bug: the mutation tests
(``test_equivalence_mutations.py``) perturb one reduction by 1e-6 and see this check fail. fp32 would hide
such a bug under its own noise (its AdamW-amplified parameter differences reach 1e-5 on some CPUs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import trainmesh as tm
from trainmesh import api
from trainmesh.data import TokenData, TokenSequence, documents_from_eos, get_batch
from trainmesh.distributed.comm import Comm
from trainmesh.distributed.mesh import Mesh
from trainmesh.distributed.testing import run_ranks
from trainmesh.models import preset, spec_of
from trainmesh.models.documents import Packing, packed
from trainmesh.pipeline.runtime import PipelineRuntime
from trainmesh.tracking.metrics import SavedActivations
from trainmesh.training.engine import Engine, MicroBatches
from trainmesh.training.optim import LRSchedule
from trainmesh.training.precision import dtype_of

FP64_ATOL = 1e-9

EQUIVALENCE_TABLE: list[tuple[str, float, float]] = []  # (layout, |Δloss|, |Δparam|), printed by conftest

Training = tuple[list[float], dict[str, torch.Tensor]]

EVAL_STEP_BASE = 1_000_000_000  # held-out batches are drawn as steps no run reaches, as the command line draws them
MOE_DEFAULTS = {"capacity_factor": 0.0, "aux_coef": 0.01, "z_coef": 0.001, "bias_rate": 0.0}
"""The routing settings a case's MoE layers get unless it overrides them (``moe=``): the command line's
defaults, which the cases were first written against."""


@dataclass(frozen=True)
class Case:
    """One training run of a test: a model preset (``model``; ``moe`` replaces fields of its MoE layers'
    :class:`~trainmesh.models.moe.MoEConfig`), the layout as :func:`trainmesh.init_mesh` and
    :func:`trainmesh.parallelize` take it (the names of :class:`trainmesh.layout.Layout`), AdamW and its
    learning-rate schedule, ``steps`` steps of ``global_batch`` sequences drawn by ``seed`` from the default
    corpus (the Python standard library's sources, byte tokens); with ``document_eos``, packed documents, each
    ending at that byte (:func:`~trainmesh.data.documents_from_eos`)."""

    model: str = "tiny"
    moe: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 0
    seed: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp_replicate: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    stage_layers: tuple[int, ...] = ()
    recompute: str = "none"
    precision: str = "fp32"
    reduce_dtype: str = "auto"
    cp_impl: str = "ring"
    bucket_mb: float = 25.0
    compile: bool = False
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 2
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    steps: int = 10
    global_batch: int = 8
    document_eos: int | None = None

    @property
    def micro_batch(self) -> int:
        """Sequences in one micro-batch on one data-parallel rank."""
        return self.global_batch // (self.dp * self.microbatches)

    @property
    def model_config(self) -> Any:
        """The preset's config with the case's MoE settings and sequence length."""
        cfg = preset(self.model)
        if getattr(cfg, "moe", None) is not None:
            cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **{**MOE_DEFAULTS, **self.moe}))
        return dataclasses.replace(cfg, seq_len=self.seq_len) if self.seq_len else cfg


def config(**settings) -> Case:
    """The one way the tests build a run: ten steps of eight sequences, two warm-up steps, fp32, under
    ``settings`` (a ``stage_layers`` string such as ``"1,3"`` is read as its layer counts)."""
    if isinstance(settings.get("stage_layers"), str):
        settings["stage_layers"] = tuple(int(n) for n in settings["stage_layers"].split(",") if n)
    return Case(**settings)


def in_fp64(case: Case) -> Case:
    """The case an equivalence test runs: the same layout in float64 (gradients reduced in float64)."""
    return dataclasses.replace(case, precision="fp64", reduce_dtype="auto")


@dataclass
class Built:
    """A case built on this rank through the public API (its parallel model, optimizer and data), and the
    losses of the steps :func:`train` ran on it."""

    case: Case
    parallel: tm.ParallelModel
    opt: tm.Optimizer
    data: TokenData
    losses: list[float] = field(default_factory=list)

    @property
    def mesh(self) -> Mesh:
        return self.parallel.mesh

    @property
    def model(self) -> torch.nn.Module:
        """This rank's part of the model."""
        return self.parallel.module

    @property
    def engine(self) -> Engine:
        return self.parallel.engine

    @property
    def comm(self) -> Comm:
        return self.parallel.comm

    @property
    def pipeline(self) -> PipelineRuntime | None:
        return self.parallel.pipeline

    def batch(self, step: int, tokens: TokenSequence | None = None) -> tuple[torch.Tensor, ...]:
        """The global batch of ``step`` (of the training split unless ``tokens`` is given): the same sequences
        on every rank and in the single process, with their documents under ``case.document_eos``."""
        c = self.case
        tokens = self.data.train if tokens is None else tokens
        x, y = get_batch(tokens, c.model_config.seq_len, c.global_batch, c.seed, step)
        return (x, y) if c.document_eos is None else (x, y, documents_from_eos(x, c.document_eos))

    def micro_batches(self, step: int, tokens: TokenSequence | None = None) -> MicroBatches:
        """This rank's micro-batches of the global batch of ``step``, as :func:`trainmesh.train_step` cuts them."""
        return api.rank_slice(self.mesh, self.batch(step, tokens), self.case.microbatches)

    def forward_backward(self, step: int, saved: SavedActivations | None = None) -> torch.Tensor:
        """Accumulate the gradients of ``step``'s batch without stepping; this rank's share of the loss
        (``saved`` records the first micro-batch's activation bytes)."""
        m = self.parallel
        return api.forward_backward(m.module, m.engine, m.pipeline, self.micro_batches(step), m.criterion, saved)

    def train(self, start: int = 0, stop: int | None = None) -> None:
        """Steps ``start`` to ``stop`` (default: ``case.steps``) of :func:`trainmesh.train_step` (warm-up then
        cosine learning rate over ``case.steps``), their losses appended to ``losses``."""
        c = self.case
        schedule = LRSchedule(c.lr, c.min_lr, c.warmup_steps, c.steps)
        for step in range(start, c.steps if stop is None else stop):
            self.opt.lr = schedule.at(step)
            self.losses.append(tm.train_step(self.parallel, self.opt, self.batch(step), max_norm=c.grad_clip))

    @torch.no_grad()
    def evaluate(self, batches: int = 2) -> float:
        """Mean loss over ``batches`` global batches of the held-out split, micro-batched as in training."""
        self.model.eval()
        losses = []
        for k in range(batches):
            micro = self.micro_batches(EVAL_STEP_BASE + k, self.data.val)
            if self.pipeline is not None:
                loss = self.pipeline.evaluate(micro, self.parallel.criterion)
            else:
                loss = sum(self._loss(*mb) for mb in micro) / len(micro)
            losses.append(api.global_mean(self.mesh, loss))
        self.model.train()
        return sum(losses) / len(losses)


    def _loss(self, x: torch.Tensor, y: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        with packed(packing):
            return self.parallel.criterion(self.model(x), y)


def activation_bytes(run: Built) -> int:
    """Bytes autograd saves for backward in the first micro-batch of one step (the gradients are kept)."""
    saved = SavedActivations(run.model.parameters())
    run.forward_backward(0, saved)
    return saved.bytes


def nan_gradients(run: Built) -> Callable[[], None]:
    """Make this rank's gradients NaN in the coming backward, as a fault on one rank would; returns the undo."""
    first = next(p for p in run.model.parameters() if p.requires_grad)
    return first.register_hook(lambda g: torch.full_like(g, float("nan"))).remove


def mesh_of(case: Case) -> Mesh:
    """:func:`trainmesh.init_mesh` of the case's layout, on the CPU."""
    c = case
    return tm.init_mesh(c.dp, c.tp, c.pp, c.cp, device="cpu", ep=c.ep, dp_replicate=c.dp_replicate,
                        sequence_parallel=c.sequence_parallel, etp=c.etp)


def build(case: Case, mesh: Mesh | None = None) -> Built:
    """The case's model from its seed, parallelized over ``mesh`` (default: :func:`mesh_of` the case), its
    optimizer and its data."""
    c = case
    mesh = mesh or mesh_of(case)
    model = spec_of(c.model).builder(c.model_config, c.seed).to(mesh.device, dtype_of(c.precision))
    parallel = tm.parallelize(model, mesh, sequence_parallel=c.sequence_parallel, zero=c.zero,
                              recompute=c.recompute, schedule=c.schedule, microbatches=c.microbatches,
                              virtual_stages=c.virtual_stages, stage_layers=c.stage_layers, precision=c.precision,
                              reduce_dtype=c.reduce_dtype, bucket_mb=c.bucket_mb, compile=c.compile,
                              cp_impl=c.cp_impl)
    opt = tm.optimizer(parallel, c.lr, c.betas, c.weight_decay)
    return Built(case, parallel, opt, TokenData.load("", c.model_config.seq_len))


def train(case: Case, mesh: Mesh | None = None) -> Built:
    """The case built and trained (:meth:`Built.train`)."""
    run = build(case, mesh)
    run.train()
    return run


_REFERENCES: dict[str, Training] = {}  # single-process runs already trained in this pytest process


def single(case: Case) -> Case:
    """The same case as one process: every axis 1, same global batch and micro-batches."""
    return dataclasses.replace(case, dp=1, cp=1, tp=1, pp=1, ep=1, etp=1, dp_replicate=1, zero=0,
                               sequence_parallel=False, schedule="1f1b", virtual_stages=1, stage_layers=())


def train_single(case: Case) -> Training:
    """The reference: the case as one process, on a 1-rank mesh in this process.

    Many layouts share one reference, and training is deterministic for a given thread count, so each is
    trained once per test session and thread count, and reused."""
    key = f"{torch.get_num_threads()} threads: {single(case)!r}"
    if key not in _REFERENCES:
        run = train(single(case), mesh=Mesh.build(1, 1, 1, torch.device("cpu")))
        _REFERENCES[key] = run.losses, run.parallel.state_dict()
    return _REFERENCES[key]


def train_rank(cases: list[Case]) -> list[Training]:
    """Runs on every rank: train each case in turn; returns losses and full parameters per case."""
    torch.set_num_threads(1)
    out = []
    for case in cases:
        run = train(case)
        out.append((run.losses, run.parallel.state_dict()))
    return out


def train_and_save(case: Case, directory: str) -> dict[str, torch.Tensor]:
    """Runs on every rank: train ``case`` and save it to ``directory`` (:func:`trainmesh.save`); returns its
    full parameters."""
    torch.set_num_threads(1)
    run = train(case)
    tm.save(run.parallel, run.opt, directory, case.steps)
    return run.parallel.state_dict()


def _per_item(reference: Training, parallel: Training) -> tuple[list[float], dict[str, float]]:
    """|Δloss| of every step and max |Δ| of every parameter."""
    (ref_losses, ref_params), (losses, params) = reference, parallel
    assert len(losses) == len(ref_losses), f"{len(losses)} steps vs the single process's {len(ref_losses)}"
    assert params.keys() == ref_params.keys(), f"parameter names differ: {params.keys() ^ ref_params.keys()}"
    return ([abs(a - b) for a, b in zip(losses, ref_losses)],
            {n: (params[n].double() - ref_params[n].double()).abs().max().item() for n in ref_params})


def differences(reference: Training, parallel: Training) -> tuple[float, float]:
    """Largest per-step |Δloss| and largest |Δparam| over every parameter."""
    loss_diffs, param_diffs = _per_item(reference, parallel)
    return max(loss_diffs), max(param_diffs.values())


def assert_same_training(reference: Training, parallel: Training) -> tuple[float, float]:
    """Per-step losses and final parameters within :data:`FP64_ATOL`; returns the two largest differences."""
    loss_diffs, param_diffs = _per_item(reference, parallel)
    for step, diff in enumerate(loss_diffs):
        assert diff <= FP64_ATOL, f"step {step}: loss {parallel[0][step]!r} vs single-process {reference[0][step]!r}"
    for name, diff in param_diffs.items():
        assert diff <= FP64_ATOL, f"{name}: max |diff| {diff} vs single process"
    return max(loss_diffs), max(param_diffs.values())


def check_equivalent(cases: list[Case], world_size: int, timeout: float = 240.0) -> list[tuple[float, float]]:
    """Every case, run in float64 on ``world_size`` ranks, matches its single-process run within
    :data:`FP64_ATOL` (rank 0's view); returns (|Δloss|, |Δparam|) per case."""
    cases = [in_fp64(case) for case in cases]
    results = run_ranks(train_rank, world_size, cases, timeout=timeout)
    diffs = []
    for case, parallel in zip(cases, results[0]):
        diffs.append(assert_same_training(train_single(case), parallel))
        EQUIVALENCE_TABLE.append((describe_layout(case), *diffs[-1]))
    return diffs


def describe_layout(case: Case) -> str:
    """A short name for a layout, e.g. ``dp2 tp2 sp pp2 1f1b zero1 mb2``."""
    parts = [f"{axis}{getattr(case, axis)}" for axis in ("dp", "cp", "ep", "etp", "tp") if getattr(case, axis) > 1]
    parts += [f"hsdp{case.dp_replicate}x{case.dp // case.dp_replicate}"] if case.dp_replicate > 1 else []
    parts += [case.cp_impl] if case.cp > 1 else []
    parts += ["sp"] if case.sequence_parallel else []
    parts += ["documents"] if case.document_eos is not None else []
    if case.pp > 1:
        parts += [f"pp{case.pp}", case.schedule + (f" v{case.virtual_stages}" if case.virtual_stages > 1 else "")]
    parts += [f"zero{case.zero}"] if case.zero else []
    parts += [f"mb{case.microbatches}"] if case.microbatches > 1 else []
    return " ".join(parts + ([case.model] if case.model != "tiny" else [])) or "single"


PAGE = 4096  # what a tmpfs allocates at a time


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted at ``where``, a file system that really fills (as root; the test is
    skipped where mounting is not allowed)."""
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill_disk(disk: Path, leave_pages: int) -> None:
    """Fill ``disk`` until it is full, then give back ``leave_pages`` pages."""
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"x" * PAGE)
        f.truncate(max(0, f.tell() - leave_pages * PAGE))


def word_tokenizer(path: Path, words: list[str]) -> Path:
    """A word-level ``tokenizer.json`` of ``words`` (and ``[UNK]``) at ``path``: two of them of the same size
    differ by content only."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def child_pids(pid: int | str = "self") -> set[int]:
    """The processes whose parent is ``pid`` (this process by default), from each of its threads'
    ``/proc/PID/task/TID/children`` (Linux)."""
    pids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""A ChatML chat template (as Qwen's), rendered turn by turn."""

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And three plus three?"},
     {"role": "assistant", "content": "Six, of course."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello there, friend."}],
]


def chat_tokenizer(folder: Path, template: str = CHATML) -> Path:
    """A tokenizer folder trained here (byte-level BPE of 320 tokens with ChatML's two special tokens) holding
    ``tokenizer.json`` and a ``tokenizer_config.json`` with ``template`` as its chat template; no download."""
    pytest.importorskip("transformers")
    import json

    from trainmesh.data.tokenizer import train_bpe

    folder.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant"] * 20
    tok = train_bpe(texts, 320, folder / "tokenizer.json")._tok
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>"}))
    return folder


def chat_jsonl(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    """``conversations`` as JSONL lines of ``{"messages": [...]}``."""
    import json

    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def tiled_pairs(visible: torch.Tensor, tile: int) -> int:
    """The pairs in the ``tile`` x ``tile`` tiles of a [queries, keys] visibility matrix that hold a visible pair:
    what a fused attention kernel computes, counted tile by tile."""
    return sum(block.numel() for rows in visible.split(tile) for block in rows.split(tile, dim=1) if block.any())
