"""What an exported Hugging Face directory holds besides its weights and ``config.json``, so that it loads as
it came in: tokenizer files, special token ids, ``generation_config.json`` and an ``--init-hf`` source's
other files. Only what the checkpoint holds is exported (no path a manifest names is read), generated files
come from ``tokenizers``/``transformers``, and nothing in the export is replaced unless asked. See docs/checkpoints.md.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.manifest import HF_FILE, HF_FILE_BYTES
from trainmesh.checkpoint.store import CheckpointDamaged, KeptFile, kept_file, kept_tokenizer, notice
from trainmesh.data.tokenizer import BYTE_VOCAB, HFTokenizer
from trainmesh.models.hf import CONFIG  # kept for the source's token ids; the export writes its own
from trainmesh.storage.safe_io import IntegrityError, read_regular_with_mode, sha256_hex, write_durably

WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")  # never kept: the export writes its own
NEW_FILE_MODE = 0o644
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class Extras:
    """What to write beside the weights: the tokenizer (None: none could be found), the special token ids,
    the ``--init-hf`` source's files the checkpoint keeps (and whether its tokenizer files are the run's), and
    notes."""

    tokenizer: Any = None
    vocab_size: int = 0
    token_ids: dict[str, Any] = field(default_factory=lambda: dict.fromkeys(TOKEN_IDS))
    special: dict[str, str] = field(default_factory=dict)
    kept: dict[str, KeptFile] = field(default_factory=dict)
    source_tokenizer: bool = False
    notes: list[str] = field(default_factory=list)


def byte_tokenizer() -> Any:
    """Byte tokens as a ``tokenizers.Tokenizer``: GPT-2's byte-to-character table, byte ``b`` is id ``b``."""
    import tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(BYTE_VOCAB) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(BYTE_VOCAB + n) for n, b in enumerate(rest)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={chars[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return tok


def plan(manifest: dict, where: Path) -> Extras:
    """The extras of checkpoint ``where`` (its ``manifest``): its tokenizer and ids, its ``--init-hf`` source."""
    extras = Extras()
    record = manifest.get("tokenizer", {"kind": "bytes"})
    if record["kind"] == "bytes":
        extras.tokenizer, extras.vocab_size = byte_tokenizer(), BYTE_VOCAB
    elif (tok := _kept_tokenizer(record, where)) is not None:
        extras.tokenizer, extras.vocab_size = tok._tok, tok.vocab_size
        if tok.eos_id is not None:
            eos = tok._tok.id_to_token(tok.eos_id)
            extras.token_ids.update(eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
            extras.special.update(eos_token=eos, pad_token=eos)
    else:
        recorded = record.get("source") or record.get("path")
        extras.notes.append(f"no tokenizer written: {where} keeps no intact copy of the tokenizer it was trained "
                            f"with ({recorded}); a path its manifest names is never read")
    try:
        extras.kept = {name: KeptFile(kept_file(where, name, entry), entry["mode"])
                       for name, entry in manifest.get("hf_files", {}).items()}
    except IntegrityError as e:
        raise CheckpointDamaged(where, str(e)) from None
    theirs = extras.kept.get("tokenizer.json")
    extras.source_tokenizer = (record["kind"] != "bytes" and theirs is not None
                               and sha256_hex(theirs.data) == record["sha256"])
    if extras.source_tokenizer and CONFIG in extras.kept:  # chat data's tokenizer files come with no config
        config = _json_object(extras.kept.get(CONFIG))
        extras.token_ids = {k: _token_id(config.get(k)) for k in TOKEN_IDS}
    return extras


def _json_object(kept: KeptFile | None) -> dict:
    """A kept JSON file's object, or ``{}`` where it is missing or not one (it is data, never trusted)."""
    try:
        value = json.loads(kept.data) if kept is not None else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _token_id(value: Any) -> Any:
    """A special token id as a config may hold it (an id, or a list of them, Llama 3's ``eos_token_id``)."""
    ids = value if isinstance(value, list) and 0 < len(value) <= 64 else [value]
    return value if all(type(i) is int and 0 <= i < 2**31 for i in ids) else None


def collect(directory: Path) -> dict[str, KeptFile]:
    """What every checkpoint of a run started from ``--init-hf directory`` keeps of it, read once (at
    its first save): its regular files but the weights, each with its permissions narrowed to at most ``0644``.
    A link or anything else is skipped, never followed (a ``README.md`` linked to a key would otherwise be
    exported), and said once."""
    kept, skipped = {}, []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.endswith(WEIGHT_FILES):
            continue
        why = ("a symbolic link" if entry.is_symlink() else "not a regular file"
               if not entry.is_file(follow_symlinks=False) else "" if HF_FILE.fullmatch(entry.name)
               else "not a plain file name")
        if not why:
            try:
                data, mode = read_regular_with_mode(Path(entry.path), HF_FILE_BYTES)
                kept[entry.name] = KeptFile(data, mode & NEW_FILE_MODE)
                continue
            except OSError as e:
                why = " ".join(str(e).removeprefix(entry.path).split())
        skipped.append(f"{entry.name} ({why})")
    if skipped:
        notice(f"--init-hf {directory}: {', '.join(skipped)} not kept in the checkpoints, so not exported "
               f"(a checkpoint keeps regular files only, never through a link)")
    return kept


def _kept_tokenizer(record: dict, where: Path) -> HFTokenizer | None:
    """The copy of its tokenizer checkpoint ``where`` keeps, if it is there and of the recorded SHA-256."""
    if record["kind"] != "copy":
        return None
    try:
        return kept_tokenizer(where, record).load()
    except IntegrityError:
        return None


def chat_template_tokenizer(manifest: dict, where: Path) -> Any | None:
    """The tokenizer files checkpoint ``where`` keeps of its ``--init-hf`` source, loaded by transformers, where they
    are the run's tokenizer and hold a chat template (the one an export writes); else None."""
    extras = plan(manifest, where)
    if not extras.source_tokenizer:
        return None
    import transformers

    with tempfile.TemporaryDirectory() as scratch:
        write({name: f for name, f in extras.kept.items() if name in TOKENIZER_FILES}, Path(scratch))
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(scratch)
    return tok if tok.chat_template else None


def contents(extras: Extras, model_vocab: int) -> dict[str, KeptFile]:
    """Every file to write beside the weights and ``config.json``, by name: the kept source files (its
    tokenizer files only where they are the run's), else the run's tokenizer, and a generation config."""
    files = {name: f for name, f in extras.kept.items()
             if name != CONFIG and (name not in TOKENIZER_FILES or extras.source_tokenizer)}
    import transformers

    if extras.tokenizer is not None and not extras.source_tokenizer:
        files |= _rendered(transformers.PreTrainedTokenizerFast(tokenizer_object=extras.tokenizer,
                                                                **extras.special).save_pretrained)
        files["special_tokens_map.json"] = KeptFile((json.dumps(extras.special, indent=2) + "\n").encode(),
                                                    NEW_FILE_MODE)
    if "generation_config.json" not in files:
        padded = list(range(extras.vocab_size, model_vocab)) if extras.vocab_size else []
        files |= _rendered(transformers.GenerationConfig(**extras.token_ids,
                                                         **({"suppress_tokens": padded} if padded else {})
                                                         ).save_pretrained)
    return files


def _rendered(save: Callable[[str], Any]) -> dict[str, KeptFile]:
    """The files ``save`` writes into a directory, written to a scratch one so that a library never writes
    into (or through a link in) the export directory."""
    with tempfile.TemporaryDirectory() as scratch:
        save(scratch)
        return {p.name: KeptFile(p.read_bytes(), NEW_FILE_MODE) for p in sorted(Path(scratch).iterdir()) if p.is_file()}


def clashes(out: Path, names: list[str]) -> list[str]:
    """Which of ``names`` already have an entry in ``out`` (a link counts): the user's files, never replaced
    unless asked."""
    return [name for name in names if os.path.lexists(out / name)]


def write(files: dict[str, KeptFile], out: Path) -> list[str]:
    """Write ``files`` into ``out`` as new files (never through a link) with their modes; returns their names."""
    for name, f in files.items():
        write_durably(out / name, f.data, f.mode)
    return list(files)
