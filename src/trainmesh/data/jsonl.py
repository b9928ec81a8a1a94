"""The ``text`` field of each line of a JSONL file, in bounded memory however long the line: long lines are read in
parts (:class:`LongLine`) and their ``text`` decoded run by run. Each line must be one object with a valid-Unicode
string ``text``."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from trainmesh.data.text import DataError, decode_utf8, utf8_error

TEXT_FIELD = "text"
_WHITESPACE = re.compile(r"[ \t\r]*")
_RUN = re.compile(r'(?:[^"\\\x00-\x1f]+|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})+')
_SURROGATE = re.compile("[\ud800-\udfff]")
_HIGH = range(0xD800, 0xDC00)
_ESCAPE_CHARS = 6
_NUMBER_TAIL = 32
_DECODER = json.JSONDecoder()

Reads = Iterator[tuple[str, int]]
"""A document's text in parts, each with the input bytes it consumed (for progress)."""


def _shape_error(where: str) -> DataError:
    return DataError(f"{where}: not a JSON object with a string {TEXT_FIELD!r} field")


def check_unicode(text: str, where: str, before: int = 0) -> None:
    """Refuse a lone surrogate (``before``: characters of the document ahead of ``text``)."""
    bad = _SURROGATE.search(text)
    if bad:
        raise DataError(f"{where}: the {TEXT_FIELD!r} field has a lone surrogate \\u{ord(bad.group()):04x} at "
                        f"character {before + bad.start()}, which is not Unicode text; fix or drop that line")


def _short_line(line: bytes, where: str) -> str:
    try:
        text = json.loads(line)[TEXT_FIELD]
    except UnicodeDecodeError as e:
        raise utf8_error(where, e, 0) from None
    except (ValueError, KeyError, TypeError, RecursionError):
        raise _shape_error(where) from None
    if not isinstance(text, str):
        raise DataError(f"{where}: the {TEXT_FIELD!r} field is {type(text).__name__}, not a string")
    if line.count(b'"' + TEXT_FIELD.encode() + b'"') > 1 and \
            [k for k, _ in json.loads(line, object_pairs_hook=list)].count(TEXT_FIELD) > 1:
        raise _twice(where)  # json.loads would keep the last; a streamed line cannot
    check_unicode(text, where)
    return text


def _twice(where: str) -> DataError:
    return DataError(f"{where}: two {TEXT_FIELD!r} fields; keep one")


class LongLine:
    """One line too long to parse whole, read ``read_bytes`` at a time up to its newline; ``buf[pos:]``, the decoded
    text not yet parsed, never holds more than one read beyond what is being parsed."""

    def __init__(self, f: BinaryIO, head: bytes, where: str, read_bytes: int) -> None:
        self.f, self.where, self.read_bytes = f, where, read_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.ended, self.offset, self.unreported = "", 0, False, 0, 0
        self._add(head)

    def _add(self, raw: bytes) -> None:
        self.ended = not raw or raw.endswith(b"\n")
        text = decode_utf8(self.decoder, raw, self.where, self.offset, final=self.ended)
        self.offset += len(raw)
        self.unreported += len(raw)
        self.buf, self.pos = self.buf[self.pos:] + text, 0

    def more(self) -> bool:
        """Read on; False at the end of the line."""
        if self.ended:
            return False
        self._add(self.f.readline(self.read_bytes))
        return True

    def consumed(self) -> int:
        """Input bytes read since the last call."""
        n, self.unreported = self.unreported, 0
        return n

    def peek(self) -> str:
        """The next character that is not JSON whitespace; "" at the end of the line."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return "" if self.buf[self.pos] == "\n" else self.buf[self.pos]
            if not self.more():
                return ""

    def expect(self, chars: str) -> str:
        c = self.peek()
        if not c or c not in chars:
            raise _shape_error(self.where)
        self.pos += 1
        return c

    def value(self) -> Any:
        """The next JSON value, whole; a value longer than ``read_bytes`` is refused."""
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buf, self.pos)
            except (ValueError, RecursionError):
                value, end = None, -1
            cut_number = type(value) in (int, float) and len(self.buf) - end < _NUMBER_TAIL  # may go on
            if self.ended or end >= 0 and not cut_number:
                break
            if end < 0 and len(self.buf) - self.pos > self.read_bytes:
                raise DataError(f"{self.where}: a field other than {TEXT_FIELD!r} is longer than {self.read_bytes:,} "
                                f"bytes in a line this long; shorten it or drop it from the JSONL")
            self.more()
        if end < 0:
            raise _shape_error(self.where)
        self.pos = end
        return value

    def string(self) -> Reads:
        """The string whose opening quote was just read, decoded in parts of ``read_bytes`` characters (the
        last shorter), as a text file's reads are; the closing quote is consumed."""
        parts: list[str] = []
        size = done = 0
        while True:
            run = _RUN.match(self.buf, self.pos)
            if run:
                end, raw = run.end(), run.group()
                text = json.decoder.scanstring(raw + '"', 0)[0] if "\\" in raw else raw
                if ord(text[-1]) in _HIGH and not self.ended and len(self.buf) - end < _ESCAPE_CHARS:
                    end, text = end - _ESCAPE_CHARS, text[:-1]  # its low half may be in the next read
                    if end == self.pos:
                        self.more()
                        continue
                check_unicode(text, self.where, done + size)
                parts.append(text)
                size += len(text)
                self.pos = end
            elif self.pos == len(self.buf):
                if not self.more():
                    raise _shape_error(self.where)
            elif self.buf[self.pos] == '"':
                self.pos += 1
                yield "".join(parts), self.consumed()
                return
            elif not (self.buf[self.pos] == "\\" and len(self.buf) - self.pos < _ESCAPE_CHARS and self.more()):
                raise _shape_error(self.where)  # a bad escape or a raw control character
            while size >= self.read_bytes:
                joined = "".join(parts)
                yield joined[:self.read_bytes], self.consumed()
                parts, done, size = [joined[self.read_bytes:]], done + self.read_bytes, size - self.read_bytes

    def text_reads(self) -> Reads:
        """The ``text`` field, the rest of the line parsed and checked (its bytes reported last)."""
        self.expect("{")
        if self.peek() == "}":
            raise _shape_error(self.where)
        found = False
        while True:
            key = self.value()
            if not isinstance(key, str):
                raise _shape_error(self.where)
            self.expect(":")
            if key != TEXT_FIELD:
                self.value()
            elif found:
                raise _twice(self.where)
            elif self.peek() == '"':
                found, self.pos = True, self.pos + 1
                yield from self.string()
            else:
                value = self.value()
                raise DataError(f"{self.where}: the {TEXT_FIELD!r} field is {type(value).__name__}, not a string")
            if self.expect(",}") == "}":
                break
        if self.peek() or not found:
            raise _shape_error(self.where)
        yield "", self.consumed()


def jsonl_documents(path: Path, read_bytes: int) -> Iterator[Reads]:
    """Each non-blank line's ``text`` as reads; consume one document's reads before asking for the next."""
    with open(path, "rb") as f:
        n = 0
        while head := f.readline(read_bytes):
            n += 1
            if head.endswith(b"\n") or len(head) < read_bytes:
                if head.strip():
                    yield iter([(_short_line(head, f"{path}:{n}"), len(head))])
                continue
            line = LongLine(f, head, f"{path}:{n}", read_bytes)
            if line.peek():
                yield line.text_reads()
            else:
                line.consumed()
