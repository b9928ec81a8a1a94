"""Chat data for supervised fine-tuning: JSONL conversations rendered with a tokenizer folder's chat template by
transformers' own sandboxed Jinja renderer (``apply_chat_template``; no template code runs outside it), tokenized
whole, each token labelled: trained or not (:data:`TRAINED`) and first of its conversation (:data:`START`).

Which tokens are trained: ``assistant`` (the default) marks the characters each assistant turn adds to the rendering
(from the end of the rendered prompt with its generation prompt to the end of the rendered turn, so the turn's
end-of-turn tokens are trained too), found by rendering each prefix of the conversation; ``all`` trains every token.
Any template works this way, ``{% generation %}`` markers or not (docs/data.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
import numpy as np

from trainmesh.data.text import DataError
from trainmesh.data.tokenizer import TOKENIZER_FILE, HFTokenizer

TRAINED = 1
"""Label bit: the token is a trained target (its prediction from the token before counts in the loss)."""
START = 2
"""Label bit: the token opens a conversation (never a trained target: nothing before it is of its conversation)."""
TRAIN_ON = ("assistant", "all")
ROLES_FIELD = "messages"
TEMPLATE_DIR = "chat-template"
"""Where prepared chat data keeps its tokenizer folder's tokenizer files (the chat template among them), for a run
that does not start from an ``--init-hf`` folder to keep in its checkpoints and export."""
TEMPLATE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                  "chat_template.json")


def tokenizer_json(folder: str) -> Path:
    """The ``tokenizer.json`` of a tokenizer folder, refused in one line if the folder has none."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"--chat needs --tokenizer to be a tokenizer folder holding {TOKENIZER_FILE} and a chat "
                        f"template (tokenizer_config.json's chat_template, or chat_template.jinja); {folder} has no "
                        f"{TOKENIZER_FILE}")
    return path


class ChatRenderer:
    """A tokenizer folder's chat template and the run's pinned tokenizer: conversations to ids and labels."""

    def __init__(self, folder: str, tok: HFTokenizer, train_on: str = "assistant") -> None:
        if train_on not in TRAIN_ON:
            raise DataError(f"--train-on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
        try:
            import transformers
        except ImportError:
            raise DataError("--chat renders chat templates with transformers; pip install 'trainmesh[hf]'") from None
        self.template = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        if not self.template.chat_template:
            raise DataError(f"tokenizer folder {folder} has no chat template; add one as chat_template.jinja (or "
                            f"tokenizer_config.json's chat_template)")
        self.tok, self.train_on = tok, train_on

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (transformers renders it in its sandbox)."""
        return self.template.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def trained_spans(self, messages: list[dict[str, str]], text: str, where: str) -> list[tuple[int, int]]:
        """The character spans of ``text`` (the whole rendering) that are trained."""
        if self.train_on == "all":
            return [(0, len(text))]
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.render(messages[:i], generation_prompt=True), self.render(messages[:i + 1])
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(f"{where}: the chat template does not render this conversation's turns as "
                                f"prefixes of one another (turn {i}), so the assistant's tokens cannot be found; "
                                f"use --train-on all or a template that renders turn by turn")
            spans.append((len(before), len(through)))
        return spans

    def encode(self, messages: list[dict[str, str]], where: str) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's token ids (the rendering tokenized whole, as ``apply_chat_template`` tokenizes
        it) and each token's label bits; a token is trained if its first character is in a trained span."""
        text = self.render(messages)
        spans = self.trained_spans(messages, text, where)
        ids, offsets = self.tok.encode_with_offsets(text)
        if not ids:
            raise DataError(f"{where}: the conversation renders to no tokens; drop that line")
        starts = np.array([start for start, _ in offsets], dtype=np.int64)
        trained = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            trained |= (starts >= lo) & (starts < hi)
        labels = trained.astype(np.uint8) * TRAINED
        labels[0] |= START
        return np.asarray(ids, dtype=np.int64), labels


def keep_template(folder: str, pinned_tokenizer: bytes, out: Path) -> None:
    """Copy the tokenizer folder's files that hold the chat template and special tokens into ``out/TEMPLATE_DIR``,
    beside the exact tokenizer bytes the data was made with (so a checkpoint takes them as the run's tokenizer)."""
    kept = out / TEMPLATE_DIR
    kept.mkdir()
    (kept / TOKENIZER_FILE).write_bytes(pinned_tokenizer)
    for name in TEMPLATE_FILES:
        source = Path(folder) / name
        if source.is_file() and not source.is_symlink():
            (kept / name).write_bytes(source.read_bytes())


def template_dir(data: str) -> str:
    """The folder of tokenizer files prepared chat data ``data`` keeps (:data:`TEMPLATE_DIR`), else ``""``."""
    kept = Path(data) / TEMPLATE_DIR
    return str(kept) if data and kept.is_dir() else ""


def _messages(line: bytes, where: str) -> list[dict[str, str]]:
    """One line's ``messages``: a list of objects with string ``role`` and ``content``."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise DataError(f"{where}: not a JSON line ({str(e).splitlines()[0]}); fix or drop that line") from None
    messages = record.get(ROLES_FIELD) if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f'{where}: not a conversation: --chat reads one {{"{ROLES_FIELD}": [{{"role": ..., '
                        f'"content": ...}}, ...]}} object per line, each role and content a string')
    return messages


def conversations(path: Path) -> Iterator[tuple[str, list[dict[str, str]], int]]:
    """Each non-blank line of JSONL file ``path``: where it is (for messages), its messages, its bytes."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                where = f"{path}:{n}"
                yield where, _messages(line, where), len(line)

