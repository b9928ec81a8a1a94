"""What a checkpoint manifest may hold, checked before any of it is used.

Anyone with write access could edit and re-hash a manifest, so every value is checked against this schema
first: types, ranges, plain names, allowed dtypes, and pieces tiling each tensor exactly. The tiling check
is linear (a byte map bounded by the files' checked sizes), not pairwise. Details: docs/checkpoints.md."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from typing import Any

import numpy as np

from trainmesh.models import any_config, family, preset
from trainmesh.models.rope import RopeScaling

FORMAT, VERSION = "trainmesh-checkpoint", 2
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "uint8": 1}
FILE_NAME = re.compile(r"rank-\d{5,9}\.safetensors")
TENSOR_NAME = re.compile(r"(model|optim)/[\w.]{1,200}(/(exp_avg|exp_avg_sq|step))?|buffer/[\w.]{1,200}|"
                         r"rng/\d{1,9}/(cpu|cuda)")
HEX64 = re.compile(r"[0-9a-f]{64}")
RUN_ID = re.compile(r"[0-9a-f]{32}")
MAX_DIMS = 8
MAX_INT = 2**62
KEYS = {"format", "version", "step", "progress", "loss_scaler", "model", "config", "layout", "run", "tensors",
        "files", "sha256"}
OPTIONAL_KEYS = {"tokenizer", "model_source", "hf_files"}  # absent in older checkpoints: byte tokens, the model
# named by preset, no files of an ``--init-hf`` source kept
HF_FILE = re.compile(r"(?!\.\.?$)[\w.+-]{1,200}")  # a plain file name of a model folder, never a path
HF_FILE_BYTES = 2**30
SOURCE_KEYS = ("family", "source")
SOURCE_TEXT = re.compile(r"[^\x00-\x1f\x7f]{1,4200}")
TOKENIZER_KEYS = {"bytes": ("kind",), "file": ("kind", "path", "sha256"), "copy": ("kind", "sha256", "bytes", "source")}
TOKENIZER_BYTES = 2**30
TOKENIZER_PATH = re.compile(r"[^\x00-\x1f\x7f]{1,4096}")
PROGRESS_KEYS = ("step", "skipped_steps", "bad_steps_in_a_row")
SCALER_KEYS = ("scale", "clean_steps", "skipped_steps")
LAYOUT_KEYS = ("world_size", "dp", "tp", "pp", "zero")
LAYOUT_TEXT = ("schedule", "precision")  # :meth:`trainmesh.layout.Layout.record`'s names; the rest are integers
LAYOUT_NEWER = ("cp", "ep", "etp", "dp_replicate", "microbatches", *LAYOUT_TEXT)  # absent in older checkpoints
PIECE_KEYS = {"key", "file", "offsets", "sizes"}


class ManifestError(ValueError):
    """A manifest value outside the schema; the message says which and why, on one line."""


def show(value: Any, limit: int = 60) -> str:
    """A value from disk, quoted on one line and cut short: safe to put in a message."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def _int(value: Any, where: str, low: int = 0, high: int = MAX_INT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ManifestError(f"{where} is {show(value)}; it must be an integer from {low} to {high}")
    return value


def _dict(value: Any, where: str, keys: set[str] | tuple[str, ...] | None = None,
          optional: set[str] | tuple[str, ...] = ()) -> dict:
    if not isinstance(value, dict):
        raise ManifestError(f"{where} is {show(value)}; it must be an object")
    if keys is not None and not set(keys) <= set(value) <= set(keys) | set(optional):
        missing, extra = sorted(set(keys) - set(value)), sorted(set(value) - set(keys) - set(optional))
        raise ManifestError(f"{where} has keys missing {show(missing)} or unexpected {show(extra)}")
    return value


def _ints(value: Any, where: str, length: int, low: int) -> list[int]:
    if not isinstance(value, list) or len(value) != length:
        raise ManifestError(f"{where} is {show(value)}; it must be a list of {length} integers")
    return [_int(v, where, low) for v in value]


def _are_ints(value: Any, length: int, low: int) -> bool:
    """:func:`_ints`'s test without building a message: the fast path for the many pieces."""
    return isinstance(value, list) and len(value) == length and all(type(v) is int and low <= v <= MAX_INT
                                                                     for v in value)


def _text(value: Any, where: str, pattern: re.Pattern) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ManifestError(f"{where} is {show(value)}; it must match {pattern.pattern}")
    return value


def check_manifest(manifest: Any, step_name: str) -> None:
    """Raise :class:`ManifestError` unless ``manifest`` (parsed JSON) is a well-formed manifest of the
    checkpoint directory named ``step_name``; afterwards every value the reader uses has the type and
    range it expects. Linear in the manifest. Whether the pieces tile their tensors is
    :func:`check_tiling`'s question, asked once the files are known to have the sizes listed here."""
    m = _dict(manifest, "the manifest", KEYS, OPTIONAL_KEYS)
    step = _int(m["step"], "step")
    if step_name != f"step-{step:08d}":
        raise ManifestError(f"step {step} is not the step of its directory {step_name}; it was moved or edited")
    _check_progress(m, step)
    _check_scalars(m)
    if "tokenizer" in m:
        _check_tokenizer(m["tokenizer"])
    if "hf_files" in m:
        _check_hf_files(_dict(m["hf_files"], "hf_files"))
    files = _check_files(_dict(m["files"], "files"))
    _check_tensors(_dict(m["tensors"], "tensors"), files)


def _check_progress(m: dict, step: int) -> None:
    progress = {k: _int(v, f"progress.{k}") for k, v in _dict(m["progress"], "progress", PROGRESS_KEYS).items()}
    if progress["step"] != step:
        raise ManifestError(f"progress.step {progress['step']} differs from step {step}")
    if not progress["bad_steps_in_a_row"] <= progress["skipped_steps"] <= step:
        raise ManifestError(f"progress counts {show(progress)} are impossible: need bad_steps_in_a_row <= "
                            f"skipped_steps <= step")


def _expected_model(m: dict) -> tuple[Any, str]:
    """The config ``m["model"]`` must match the fields of, and how to name it: the family's (any preset of
    it) where the manifest records the model's source, else the preset ``config.model`` names. None for a
    model of no family (one the Python API trained): its tensors' names and shapes are what a load checks."""
    if "model_source" in m:
        source = _dict(m["model_source"], "model_source", SOURCE_KEYS, ("hf_config",))
        _text(source["source"], "model_source.source", SOURCE_TEXT)
        if "hf_config" in source:
            _dict(source["hf_config"], "model_source.hf_config")
        if source["family"] == "":
            return None, ""
        try:
            spec = family(_text(source["family"], "model_source.family", re.compile(r"[\w.-]{1,64}")))
        except ValueError:
            raise ManifestError(f"model_source.family {show(source['family'])} is no model family trainmesh "
                                f"knows") from None
        return any_config(spec), f"family {spec.family}"
    name = _dict(m["config"], "config").get("model")
    if name == "":
        return None, ""
    _text(name, "config.model", re.compile(r"[\w.-]{1,64}"))
    try:
        return preset(name), f"preset {name}"
    except ValueError:
        raise ManifestError(f"config.model {show(name)} is not a model preset trainmesh knows") from None


def _rope_scaling(value: Any) -> None:
    """``model.rope_scaling``: none, or the fields of a :class:`~trainmesh.models.rope.RopeScaling`."""
    if value is None:
        return
    try:
        RopeScaling(**_dict(value, "model.rope_scaling"))
    except (TypeError, ValueError) as e:
        raise ManifestError(f"model.rope_scaling is {show(value)}: {e}") from None


def _check_model_shape(model: Any, expected: Any, name: str) -> None:
    """``model`` holds exactly the fields of config ``expected`` (``name``), each of its type: whole numbers
    at least 1, finite positive floats, booleans; ``{}`` where ``expected`` is None."""
    if expected is None:
        _dict(model, "model", ())
        return
    fields = {f.name: f for f in dataclasses.fields(expected)}
    # A field with a default (``moe``, the attention options) is a feature newer than some checkpoints:
    # absent means its default, off.
    optional = tuple(k for k, f in fields.items() if f.default is not dataclasses.MISSING)
    required = tuple(k for k in fields if k not in optional)
    for k, v in _dict(model, "model", required, optional).items():
        kind = type(getattr(expected, k))
        if fields[k].default is None and "int" in str(fields[k].type):  # a size that may be off (a window)
            if v is not None:
                _int(v, f"model.{k}", 1)
            continue
        if k == "rope_scaling":  # any model of a family may have one
            _rope_scaling(v)
            continue
        if fields[k].default is None and "float" in str(fields[k].type):  # a number that may be off (a rope base)
            if v is not None:
                _positive_float(v, f"model.{k}")
            continue
        if fields[k].default is None:  # a sub-config (``moe``): present exactly where the family has one
            if (v is None) != (getattr(expected, k) is None) or not (v is None or isinstance(v, dict)):
                raise ManifestError(f"model.{k} is {show(v)}; {name} has {getattr(expected, k)}")
            continue
        if kind is bool and type(v) is not bool:
            raise ManifestError(f"model.{k} is {show(v)}; it must be true or false")
        if kind is float:
            _positive_float(v, f"model.{k}")
        if kind is int:
            _int(v, f"model.{k}", 0 if fields[k].default == 0 else 1)  # a size defaulting to 0 is off at 0


def _positive_float(v: Any, what: str) -> None:
    if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
        raise ManifestError(f"{what} is {show(v)}; it must be a finite number above 0")


def _check_scalars(m: dict) -> None:
    """Loss scaler, model shape, layout, run identity and the recorded config."""
    scaler = _dict(m["loss_scaler"], "loss_scaler", SCALER_KEYS)
    scale = scaler["scale"]
    if type(scale) not in (int, float) or not math.isfinite(scale) or scale <= 0:
        raise ManifestError(f"loss_scaler.scale is {show(scale)}; it must be a finite number above 0")
    _int(scaler["clean_steps"], "loss_scaler.clean_steps")
    _int(scaler["skipped_steps"], "loss_scaler.skipped_steps")
    _check_model_shape(m["model"], *_expected_model(m))
    raw = _dict(m["layout"], "layout", LAYOUT_KEYS, LAYOUT_NEWER)
    layout = {k: _int(v, f"layout.{k}", 0 if k == "zero" else 1, 3 if k == "zero" else 2**20)
              for k, v in raw.items() if k not in LAYOUT_TEXT}
    for k in set(LAYOUT_TEXT) & set(raw):
        _text(raw[k], f"layout.{k}", re.compile(r"[\w-]{1,16}"))
    if layout["world_size"] != layout["dp"] * layout.get("cp", 1) * layout["tp"] * layout["pp"]:
        raise ManifestError(f"layout {show(layout)} has world_size != dp * cp * tp * pp")
    if (layout["dp"] * layout.get("cp", 1) * layout["tp"]) % layout.get("ep", 1):  # ep folds over tp under SP
        raise ManifestError(f"layout {show(layout)} has an ep that does not divide dp * cp * tp")
    run = _dict(m["run"], "run", ("id", "config_sha256"))
    _text(run["id"], "run.id", RUN_ID)
    _text(run["config_sha256"], "run.config_sha256", HEX64)
    config = m["config"]
    odd = [k for k, v in config.items() if not isinstance(v, (str, int, float, bool, type(None)))
           and not (isinstance(v, list) and all(type(n) is int for n in v))]  # stage_layers: [1, 3]
    if odd:
        raise ManifestError(f"config.{show(odd[0])} is not a plain value")


def _check_tokenizer(record: Any) -> None:
    """``{"kind": "bytes"}``; ``{"kind": "copy"}``: the SHA-256 and size of the ``tokenizer.json`` kept in the
    step directory and the path it was copied from (shown, never read); or, from older checkpoints,
    ``{"kind": "file"}`` with a path (never read either: a reader asks for ``--tokenizer``) and SHA-256."""
    kind = _dict(record, "tokenizer").get("kind")
    if kind not in TOKENIZER_KEYS:
        raise ManifestError(f"tokenizer.kind is {show(kind)}; it must be one of {', '.join(TOKENIZER_KEYS)}")
    _dict(record, "tokenizer", TOKENIZER_KEYS[kind])
    if kind == "bytes":
        return
    _text(record["path" if kind == "file" else "source"], f"tokenizer.{'path' if kind == 'file' else 'source'}",
          TOKENIZER_PATH)
    _text(record["sha256"], "tokenizer.sha256", HEX64)
    if kind == "copy" and not 0 < _int(record["bytes"], "tokenizer.bytes") <= TOKENIZER_BYTES:
        raise ManifestError(f"tokenizer.bytes is {record['bytes']}; it must be from 1 to {TOKENIZER_BYTES}")


def _check_hf_files(files: dict) -> None:
    """The files of an ``--init-hf`` source the checkpoint keeps (``hf-<name>`` beside its shards): plain
    names, each with its SHA-256, size, and permissions no wider than ``0644``."""
    for name, entry in files.items():
        _text(name, "an hf_files name", HF_FILE)
        entry = _dict(entry, f"hf_files.{name}", ("sha256", "bytes", "mode"))
        _text(entry["sha256"], f"hf_files.{name}.sha256", HEX64)
        _int(entry["bytes"], f"hf_files.{name}.bytes", 0, HF_FILE_BYTES)
        if _int(entry["mode"], f"hf_files.{name}.mode", 0, 0o644) & ~0o644:
            raise ManifestError(f"hf_files.{name}.mode is {oct(entry['mode'])}; a kept file is at most 0o644")


def _check_files(files: dict) -> dict[str, int]:
    """Each file's recorded size, by name; names are plain ``rank-N.safetensors``, never a path."""
    if not files:
        raise ManifestError("files is empty")
    sizes = {}
    for name, entry in files.items():
        _text(name, "a file name", FILE_NAME)
        entry = _dict(entry, f"files.{name}", ("sha256", "bytes"))
        _text(entry["sha256"], f"files.{name}.sha256", HEX64)
        sizes[name] = _int(entry["bytes"], f"files.{name}.bytes")
    return sizes


def _check_tensors(tensors: dict, file_bytes: dict[str, int]) -> None:
    """Every tensor's entry, its pieces' boxes and keys, and that the pieces fit in their files' bytes."""
    used: dict[str, int] = defaultdict(int)
    seen: set[tuple[str, str]] = set()
    for name, entry in tensors.items():
        _text(name, "a tensor name", TENSOR_NAME)
        entry = _dict(entry, f"tensor {name}", ("shape", "dtype", "pieces"))
        shape = entry["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise ManifestError(f"tensor {name}: shape {show(shape)} is not a list of at most {MAX_DIMS} sizes")
        shape = _ints(shape, f"tensor {name}: shape", len(shape), 1)
        dtype = entry["dtype"]
        allowed = ("uint8",) if name.startswith("rng/") else tuple(d for d in ITEM_BYTES if d != "uint8")
        if dtype not in allowed:
            raise ManifestError(f"tensor {name}: dtype {show(dtype)} is not one of {', '.join(allowed)}")
        pieces = entry["pieces"]
        if not isinstance(pieces, list) or not pieces:
            raise ManifestError(f"tensor {name}: pieces is {show(pieces)}; it must be a non-empty list")
        for piece in pieces:
            _check_piece(piece, name, shape, file_bytes, seen)
            used[piece["file"]] += math.prod(piece["sizes"]) * ITEM_BYTES[dtype]
    for file, nbytes in used.items():
        if nbytes > file_bytes[file]:
            raise ManifestError(f"the pieces in {file} need {nbytes} bytes but the file has {file_bytes[file]}")


def _check_piece(piece: Any, name: str, shape: list[int], file_bytes: dict[str, int],
                 seen: set[tuple[str, str]]) -> None:
    """One piece: inside its tensor, in a listed file, under the key its box gives it, listed once."""
    where = f"a piece of {name}"
    if not isinstance(piece, dict) or piece.keys() != PIECE_KEYS:
        _dict(piece, where, PIECE_KEYS)
    offsets, sizes = piece["offsets"], piece["sizes"]
    if not _are_ints(offsets, len(shape), 0) or not _are_ints(sizes, len(shape), 1):
        _ints(offsets, f"{where}: offsets", len(shape), 0)
        _ints(sizes, f"{where}: sizes", len(shape), 1)
    if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
        raise ManifestError(f"{where} at {offsets} of sizes {sizes} reaches outside its shape {shape}")
    if not isinstance(piece["file"], str) or piece["file"] not in file_bytes:
        raise ManifestError(f"{where} names file {show(piece['file'])}, which files does not list")
    key = f"{name}@{','.join(map(str, offsets))}"
    if piece["key"] != key:
        raise ManifestError(f"{where} has key {show(piece['key'])}; its offsets give {show(key)}")
    if (piece["file"], key) in seen:
        raise ManifestError(f"{where}: key {show(key)} is listed twice")
    seen.add((piece["file"], key))


def check_tiling(manifest: dict) -> None:
    """Raise :class:`ManifestError` unless the pieces of every tensor of ``manifest`` (which passed
    :func:`check_manifest`, and whose files have the sizes it lists) cover it exactly once."""
    for name, entry in manifest["tensors"].items():
        _check_tiling(name, entry["shape"], entry["pieces"])


def _check_tiling(name: str, shape: list[int], pieces: list[dict]) -> None:
    """If the pieces' sizes add up to the tensor's, an element marked twice leaves another unmarked (also
    with the byte map's wrap-around), so one all-ones test settles both gaps and overlaps. The sum is
    checked first, so the map is no larger than the pieces' bytes in their files."""
    total = math.prod(shape)
    if sum(math.prod(p["sizes"]) for p in pieces) != total:
        raise ManifestError(f"the pieces of {name} do not add up to its {total} elements")
    marks = np.zeros(shape, dtype=np.uint8)
    for p in pieces:
        marks[tuple(slice(o, o + s) for o, s in zip(p["offsets"], p["sizes"]))] += 1
    if not (marks == 1).all():
        raise ManifestError(f"the pieces of {name} overlap and leave a gap in its shape {shape}")
