"""Text generation from a checkpoint: ``trainmesh generate``.

A checkpoint of any layout is assembled in one process and decoded with a key/value cache and the
tokenizer it records (another is refused by SHA-256: a wrong vocabulary prints fluent nonsense). A full
context drops its oldest half; sampling is float64 on the CPU, so a seed gives the same text anywhere."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainmesh.checkpoint import (MANIFEST, CheckpointDamaged, CheckpointError, candidates, read_manifest, recorded_model, recorded_weights,
                                  source_name, step_dir)
from trainmesh.checkpoint import hf_extras
from trainmesh.checkpoint.store import kept_tokenizer, step_of
from trainmesh.models.cache import KVCache
from trainmesh.data.tokenizer import Tokenizer, TokenizerError, TokenizerFile, load_tokenizer
from trainmesh.storage.safe_io import IntegrityError


class GenerateError(ValueError):
    """Generation settings or inputs that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the model's logits; ``temperature=0`` is greedy."""

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise GenerateError(f"--temperature {self.temperature}: must be a finite number >= 0 (0: greedy)")
        if self.top_k < 0:
            raise GenerateError(f"--top-k {self.top_k}: must be >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p {self.top_p}: must be in (0, 1] (1: no limit)")
        if self.seed < 0:
            raise GenerateError(f"--seed {self.seed}: must be >= 0")


GREEDY = Sampling(temperature=0.0)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` (one row) with every token outside the ``top_k`` most likely (0: no limit) and outside the
    nucleus set to ``-inf``: the nucleus is the fewest most likely tokens whose probability reaches
    ``top_p``, so the most likely token always stays."""
    out = logits.clone()
    if 0 < top_k < out.numel():
        keep = torch.topk(out, top_k).indices
        out = torch.full_like(out, -math.inf).index_copy(0, keep, out[keep])
    if top_p < 1:
        probs, order = torch.sort(F.softmax(out, dim=-1), descending=True)
        before = probs.cumsum(0) - probs  # mass of the more likely tokens
        out[order[before >= top_p]] = -math.inf
    return out


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The token ``sampling`` picks from ``logits`` (one row), drawing from ``generator``."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    scaled = logits.detach().to("cpu", torch.float64) / sampling.temperature
    probs = F.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, seq_len: int,
             sampling: Sampling = GREEDY, vocab_size: int | None = None, use_cache: bool = True) -> list[int]:
    """``max_new_tokens`` tokens continuing ``prompt`` (token ids), from the first ``vocab_size`` of the model's
    outputs (a padded vocabulary's extra rows are never chosen). ``use_cache=False`` recomputes the whole
    context at every token: the reference the cache is tested against."""
    if not prompt:
        raise GenerateError("the prompt encodes to no tokens; give a longer --prompt")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens, start, cache, new = list(prompt[-seq_len:]), 0, None, []
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(torch.tensor([tokens[start:]], device=device))
        elif cache is None:
            cache = KVCache(model, seq_len)
            logits = model(torch.tensor([tokens[start:]], device=device), cache)
        else:
            logits = model(torch.tensor([tokens[-1:]], device=device), cache)
        token = next_token(logits[0, -1, :vocab_size], sampling, generator)
        tokens.append(token)
        new.append(token)
        if len(tokens) - start > seq_len:
            start, cache = len(tokens) - max(1, seq_len // 2), None
    return new


# --- from a checkpoint -----------------------------------------------------------------------------

def checkpoint_path(root: Path, step: int | None) -> Path:
    """The checkpoint ``--checkpoint-dir`` and ``--step`` name: ``root`` itself if it is a ``step-N``
    directory, else its ``step`` checkpoint, else the latest (the one ``latest`` names)."""
    if (root / MANIFEST).is_file() and step is None:
        return root
    found = candidates(root)
    if not found:
        raise CheckpointError(f"{root} holds no checkpoint; give the --checkpoint-dir a training run saved to")
    if step is None:
        return found[0]
    path = step_dir(root, step)
    if path not in found:
        steps = ", ".join(str(step_of(p)) for p in sorted(found, key=step_of))
        raise CheckpointError(f"{root} has no checkpoint of step {step}; it has steps {steps}")
    return path


def load_model(path: Path, device: torch.device) -> tuple[nn.Module, dict]:
    """The plain model of checkpoint ``path`` (written in any layout), with its saved weights, in the
    dtype they were saved in, on ``device``, in eval mode; and the checkpoint's manifest."""
    manifest = read_manifest(path)
    spec, shape = recorded_model(manifest, path)
    model = spec.builder(shape, 0)
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    tensors = recorded_weights(path, manifest)
    weights = {k: t for k, t in tensors.items() if k not in buffers}
    routing = {k: t for k, t in tensors.items() if k in buffers}
    wrong = sorted(set(params) ^ set(weights)) or [k for k in params if params[k].shape != weights[k].shape]
    if wrong:
        raise CheckpointError(f"checkpoint {path} does not hold the weights of its model {source_name(manifest)} "
                              f"({wrong[0]} differs); it was not written by trainmesh")
    dtype = next(iter(weights.values())).dtype
    model.to(device, dtype)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(weights[k])
        for k, t in routing.items():
            buffers[k].copy_(t)
    return model.eval(), manifest


def tokenizer_of(manifest: dict, path: Path, given: str | None) -> tuple[Tokenizer, str]:
    """The tokenizer checkpoint ``path`` was trained with, and a few words naming it: the copy the checkpoint
    keeps (read only from the step directory, never through a link, and checked against its SHA-256), or
    ``given`` if its SHA-256 is the recorded one. A path a manifest names is never read: a tampered one could
    name any file. Anything else is refused in one line."""
    record = manifest.get("tokenizer", {"kind": "bytes"})
    if record["kind"] == "bytes":
        if given:
            raise TokenizerError(f"checkpoint {path} was trained on byte tokens, not on --tokenizer {given}; "
                                 f"drop --tokenizer")
        return load_tokenizer(""), "byte tokens"
    digest, recorded = record["sha256"], record.get("source") or record.get("path")
    if given:
        pinned = TokenizerFile.read(given)
        if pinned.sha256 != digest:
            raise TokenizerError(f"--tokenizer {pinned.short()} is not the tokenizer checkpoint {path} was trained "
                                 f"with ({recorded}, SHA-256 {digest[:12]}); pass that file as --tokenizer")
        return pinned.load(), f"tokenizer {given}"
    if record["kind"] == "file":
        raise TokenizerError(f"checkpoint {path} names its tokenizer by a path outside it ({recorded}), which is "
                             f"not read; pass that tokenizer (SHA-256 {digest[:12]}) as --tokenizer")
    try:
        kept = kept_tokenizer(path, record)
    except IntegrityError as e:
        raise CheckpointDamaged(path, str(e)) from None
    return kept.load(), f"tokenizer {kept.source} (a copy of {recorded})"


def _device(name: str) -> torch.device:
    """``--device``: auto picks CUDA when there is a device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda but no CUDA device is visible; use --device cpu")
    return torch.device(name)


def chat_prompt(manifest: dict, path: Path, prompt: str) -> str:
    """``prompt`` as a user's message rendered with the chat template checkpoint ``path`` keeps, with the generation
    prompt, by transformers' sandboxed renderer: the text ``apply_chat_template`` gives an exported model."""
    template = hf_extras.chat_template_tokenizer(manifest, path)
    if template is None:
        raise GenerateError(f"checkpoint {path} keeps no chat template for its tokenizer; --chat needs a run on data "
                            f"prepared with --chat, or started with --init-hf DIR whose folder holds the run's "
                            f"tokenizer.json and its chat template")
    return template.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                        add_generation_prompt=True)


def generate_text(checkpoint_dir: str, prompt: str, max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                  step: int | None = None, tokenizer: str | None = None, device: str = "auto",
                  chat: bool = False) -> str:
    """The completion of ``prompt`` by the model of a checkpoint (see :func:`checkpoint_path`), decoded
    with the run's tokenizer (``chat``: the reply to ``prompt`` as a user's message, :func:`chat_prompt`); what was
    loaded and how fast it went are reported on stderr."""
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    path = checkpoint_path(Path(checkpoint_dir), step)
    model, manifest = load_model(path, _device(device))
    tok, tok_name = tokenizer_of(manifest, path, tokenizer)
    name, seq_len = source_name(manifest), manifest["model"]["seq_len"]
    ids = tok.encode(chat_prompt(manifest, path, prompt) if chat else prompt)
    if len(ids) > seq_len:
        _notice(f"the prompt is {len(ids)} tokens and {name} sees {seq_len}; it continues the last {seq_len}")
    start = time.perf_counter()
    new = generate(model, ids, max_new_tokens, seq_len, sampling, min(tok.vocab_size, model.cfg.vocab_size))
    elapsed = time.perf_counter() - start
    _notice(f"{path} ({name}, step {manifest['step']}, {tok_name}): {len(new)} tokens in {elapsed:.2f} s "
            f"({len(new) / elapsed:.0f} tokens/s)")
    return tok.decode(new)


def _notice(text: str) -> None:
    print(f"trainmesh: {text}", file=sys.stderr, flush=True)
