"""What an exported Hugging Face directory holds besides its weights and ``config.json``, so that it loads as
it came in: the run's tokenizer as Hugging Face tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``), its special token ids (for ``config.json``), a ``generation_config.json``, and,
for an ``--init-hf`` run, whatever its source directory held that training did not change.

The run's tokenizer is the one its manifest records: byte tokens (ids 0-255 are the bytes of UTF-8 text,
written as a byte-level BPE with no merges, so ``AutoTokenizer`` encodes text to exactly those ids) or a
``tokenizer.json`` (the copy the checkpoint keeps, of the recorded SHA-256; a path a manifest names is never
read). When it is the source directory's own
tokenizer, the source's tokenizer files are copied as they are (chat template included) and its special token
ids kept; a run trained on another tokenizer gets that one instead. Files are written through the
``tokenizers`` and ``transformers`` libraries, never by hand, except ``special_tokens_map.json``, which
transformers 5 no longer writes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.store import kept_tokenizer
from trainmesh.data.tokenizer import BYTE_VOCAB, HFTokenizer
from trainmesh.storage.safe_io import IntegrityError, sha256_hex

MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class Extras:
    """What to write beside the weights: the tokenizer (None: none could be found), the special token ids,
    the source directory whose files to copy (and whether its tokenizer files are the run's), and notes."""

    tokenizer: Any = None
    vocab_size: int = 0
    token_ids: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(TOKEN_IDS))
    special: dict[str, str] = field(default_factory=dict)
    source: Path | None = None
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
    init_hf = (manifest.get("config") or {}).get("init_hf")
    if init_hf and Path(init_hf).is_dir():
        extras.source = Path(init_hf)
        theirs = extras.source / "tokenizer.json"
        extras.source_tokenizer = (record["kind"] != "bytes" and theirs.is_file()
                                   and sha256_hex(theirs.read_bytes()) == record["sha256"])
        if extras.source_tokenizer:
            config = json.loads((extras.source / "config.json").read_text())
            extras.token_ids = {k: config.get(k) for k in TOKEN_IDS}
    return extras


def _kept_tokenizer(record: dict, where: Path) -> HFTokenizer | None:
    """The copy of its tokenizer checkpoint ``where`` keeps, if it is there and of the recorded SHA-256."""
    if record["kind"] != "copy":
        return None
    try:
        return kept_tokenizer(where, record).load()
    except IntegrityError:
        return None


def write(extras: Extras, out: Path, model_vocab: int) -> list[str]:
    """Write ``extras`` into ``out`` (which holds the weights and ``config.json``); returns what was written."""
    written = []
    if extras.source is not None:
        for file in sorted(extras.source.iterdir()):
            keep = file.name not in TOKENIZER_FILES or extras.source_tokenizer
            if file.is_file() and file.name not in MODEL_FILES and keep and not (out / file.name).exists():
                shutil.copyfile(file, out / file.name)
                written.append(file.name)
    if extras.tokenizer is not None and not extras.source_tokenizer:
        import transformers

        transformers.PreTrainedTokenizerFast(tokenizer_object=extras.tokenizer, **extras.special).save_pretrained(out)
        (out / "special_tokens_map.json").write_text(json.dumps(extras.special, indent=2) + "\n")
        written += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    if not (out / "generation_config.json").exists():
        import transformers

        padded = list(range(extras.vocab_size, model_vocab)) if extras.vocab_size else []
        transformers.GenerationConfig(**extras.token_ids, **({"suppress_tokens": padded} if padded else {})
                                      ).save_pretrained(out)
        written.append("generation_config.json")
    return written
