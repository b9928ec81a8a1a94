"""The streamed JSONL reader against ``json.loads``: a line longer than one read gives the same ``text``,
whatever falls on a read boundary (escapes, surrogate pairs, multi-byte characters), and bad lines are one
line naming the file, the line and what was wrong."""

import json
import random

import pytest

from trainmesh.data import sources
from trainmesh.data.jsonl import jsonl_documents
from trainmesh.data.sources import document_pieces
from trainmesh.data.text import DataError

ALPHABET = ["a", "b", " ", "\n", "\t", '"', "\\", "/", "é", "€", "😀", "\ud7ff", "\ue000", "\x00", "\x1f", "\b", "\f",
            "\r", "𝄞", "\\u", "ud83d"]


def _texts(path, read_bytes):
    return ["".join(t for t, _ in reads) for reads in jsonl_documents(path, read_bytes)]


@pytest.mark.parametrize("read_bytes", [24, 25, 31, 64])
def test_streamed_lines_decode_as_json_loads_does(tmp_path, read_bytes):
    """200 random lines (escaped as ASCII or not, the text field first, last or between others, with
    whitespace) of up to ~40 reads each decode to what json.loads gives, and their input bytes add up."""
    rng = random.Random(read_bytes)
    lines, want = [], []
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 120)))
        fields = [("id", rng.randrange(10**6)), ("x", [1.5, {"y": "z"}]), ("n", None)][:rng.randrange(4)]
        fields.insert(rng.randrange(len(fields) + 1), ("text", text))
        sep = rng.choice([(",", ":"), (", ", ": "), (" ,\t", " :  ")])
        lines.append(json.dumps(dict(fields), ensure_ascii=rng.random() < 0.5, separators=sep))
        want.append(text)
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n\n   \n", encoding="utf-8")
    assert _texts(path, read_bytes) == want
    assert sum(n for reads in jsonl_documents(path, read_bytes) for _, n in reads) <= path.stat().st_size


def test_pieces_of_a_long_line_are_bounded_and_rejoin(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE_BYTES", 1000)
    text = "".join(random.Random(0).choice(ALPHABET[:12]) for _ in range(50_000))
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"meta": "m" * 900, "text": text}) + "\n" + json.dumps({"text": "short"}) + "\n")
    got = list(sources.jsonl_pieces(path))
    assert "".join(p.text for p in got[:-1]) == text and got[-1].text == "short"
    assert [p.ends_document for p in got].count(True) == 2
    assert max(len(p.text) for p in got) <= 2 * 1000 and len(got) > 50
    assert sum(p.input_bytes for p in got) == path.stat().st_size


@pytest.mark.parametrize("line, message", [
    ('{"text": "a\\ud800b"}', r"a.jsonl:2: the 'text' field has a lone surrogate \\ud800 at character 1"),
    ('{"text": "' + "x" * 40 + '\\udc00"}', r"a.jsonl:2: the 'text' field has a lone surrogate \\udc00 at character 40"),
    ('{"text": "' + "x" * 40 + '\\ud83d"}', r"a.jsonl:2: the 'text' field has a lone surrogate \\ud83d at character 40"),
    ('{"text": "' + "x" * 40 + '\\ud83dx"}', r"lone surrogate \\ud83d at character 40"),
    ('{"text": "' + "x" * 40 + '\\ud83d\\u0041"}', r"lone surrogate \\ud83d at character 40"),
    ('{"text": ' + "1" * 40 + "}", r"a.jsonl:2: the 'text' field is int, not a string"),
    ('{"text": "' + "x" * 40 + '", "text": "y"}', r"a.jsonl:2: two 'text' fields"),
    ('{"b": 1,' + " " * 40 + '"c": 2}', r"a.jsonl:2: not a JSON object with a string 'text' field"),
    ('{"text": "' + "x" * 40 + '"} extra', r"a.jsonl:2: not a JSON object"),
    ('{"text": "' + "x" * 40 + '\\q"}', r"a.jsonl:2: not a JSON object"),
    ('{"text": "' + "x" * 40 + "\x01" + '"}', r"a.jsonl:2: not a JSON object"),
    ('{"text": "' + "x" * 40, r"a.jsonl:2: not a JSON object"),
    ('{"text": "x", "m": "' + "x" * 40 + '"}', r"a.jsonl:2: a field other than 'text' is longer than 16 bytes"),
    ('[' + '"text", ' * 10 + "1]", r"a.jsonl:2: not a JSON object"),
])
@pytest.mark.parametrize("read_bytes", [16, 1 << 20])
def test_bad_lines_are_one_line_naming_the_line(tmp_path, line, message, read_bytes):
    """Each refused as a whole line by json.loads (reads of 1 MiB) and streamed (reads of 16 bytes)."""
    if "longer than" in message and read_bytes > 16:
        return  # a short line's fields are parsed whole, at any length
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(DataError, match=message) as e:
        for reads in jsonl_documents(path, read_bytes):
            list(document_pieces(reads))
    assert "\n" not in str(e.value)


def test_invalid_utf8_in_a_long_line_names_the_offset(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "' + b"x" * 40 + b'\xff"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:1 is not UTF-8 text \(invalid byte 0xff at offset 50\)"):
        _texts(path, 16)
