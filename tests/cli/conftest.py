"""Fixtures the data tests share."""

import pytest

from trainmesh.data.text import stdlib_sources


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> str:
    """A 300-token byte-level BPE trained on a few standard-library files (needs ``tokenizers``)."""
    pytest.importorskip("tokenizers")
    from trainmesh.data.tokenizer import train_bpe

    out = tmp_path_factory.mktemp("tok") / "tok.json"
    files = [f for f in stdlib_sources() if f.name in ("json.py", "this.py", "abc.py", "bisect.py", "heapq.py")]
    train_bpe((f.read_text() for f in files), 300, out)
    return str(out)
