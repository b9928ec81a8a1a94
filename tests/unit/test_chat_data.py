"""Chat data: conversations rendered by transformers' chat template, a loss mask on the assistant's tokens (or all),
packed into windows whole, a conversation longer than a window cut and said once."""

import io
import json

import numpy as np
import pytest
import torch

from trainmesh.data import DataError, PackedWindows, TokenData, document_mix
from trainmesh.data.chat import START, TRAINED, ChatRenderer
from trainmesh.data.prepare import PrepareOptions, prepare
from trainmesh.data.sampler import pack
from trainmesh.data.shards import read_index, verify_shard
from trainmesh.data.tokenizer import HFTokenizer
from trainmesh.training.loss import IGNORE_INDEX

from helpers import CONVERSATIONS, chat_jsonl, chat_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("tok") / "chat-tok")


def _renderer(folder, train_on="assistant") -> ChatRenderer:
    return ChatRenderer(str(folder), HFTokenizer(str(folder / "tokenizer.json")), train_on)


def test_ids_are_transformers_own_and_only_the_assistant_turns_are_trained(folder):
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok = HFTokenizer(str(folder / "tokenizer.json"))
    for messages in CONVERSATIONS:
        ids, labels = _renderer(folder).encode(messages, "test")
        assert ids.tolist() == reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        trained = tok.decode(ids[(labels & TRAINED) != 0].tolist())
        assert trained == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert labels[0] & START and not (labels[1:] & START).any()


def test_train_on_all_trains_every_token(folder):
    ids, labels = _renderer(folder, "all").encode(CONVERSATIONS[0], "test")
    assert ((labels & TRAINED) != 0).all() and len(ids) == len(labels)


def test_a_template_that_does_not_render_turn_by_turn_is_refused_for_assistant_masks(tmp_path):
    reversed_turns = "{% for message in messages|reverse %}{{ message['content'] }}{% endfor %}"
    folder = chat_tokenizer(tmp_path / "tok", reversed_turns)
    with pytest.raises(DataError, match="prefixes of one another.*--train-on all"):
        _renderer(folder).encode(CONVERSATIONS[0], "chat.jsonl:1")


def test_a_line_that_is_not_a_conversation_is_refused_with_its_place(folder, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:2: not a conversation"):
        prepare(PrepareOptions((str(data),), str(folder), str(tmp_path / "out"), chat=True), io.StringIO())
    assert not (tmp_path / "out").exists()


def test_packing_keeps_conversations_whole_and_cuts_only_one_longer_than_a_window():
    # conversations of 5, 4, 21, 2 and 8 tokens into windows of 10
    windows, cut = pack(np.array([0, 5, 9, 30, 32]), 40, 10)
    assert windows.tolist() == [[0, 9], [9, 19], [19, 29], [29, 32], [32, 40]]
    assert cut == 1


def test_a_window_gives_targets_with_the_mask_and_documents_by_conversation():
    #            conv A: 3 tokens, 2nd and 3rd trained | conv B: 2 tokens, 2nd trained
    tokens = torch.tensor([10, 11, 12, 20, 21])
    labels = torch.tensor([START, TRAINED, TRAINED, START | TRAINED, TRAINED])
    windows = PackedWindows(tokens.numpy(), labels.numpy(), seq_len=6, pad_id=0)
    assert windows.windows.tolist() == [[0, 5]]
    x, y, documents = windows.window(0, 5)
    assert x.tolist() == [10, 11, 12, 20, 21, 0]
    assert y.tolist() == [11, 12, IGNORE_INDEX, 21, IGNORE_INDEX, IGNORE_INDEX]  # B's opening token: not trained
    assert documents.tolist() == [0, 0, 0, 1, 1, 2]


def test_prepare_chat_then_batches_of_whole_conversations(folder, tmp_path):
    data = chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 8)
    out = tmp_path / "out"
    log = io.StringIO()
    index = prepare(PrepareOptions((str(data),), str(folder), str(out), chat=True, val_fraction=0.25), log)
    assert "prepared 24 conversations" in log.getvalue()
    assert read_index(str(out)).train_on == "assistant" and index.shards[0].labels_sha256
    for shard in index.shards:
        verify_shard(index, shard)
    lengths = [len(_renderer(folder).encode(c, "")[0]) for c in CONVERSATIONS]
    longest = max(lengths)
    mix = document_mix(str(out))  # what the planner prices: the training split's conversations
    train_tokens = sum(s.tokens for s in index.shards if s.split == "train")
    assert set(mix) == set(lengths) and sum(mix) == train_tokens
    loaded = TokenData.load(str(out), seq_len=2 * longest)
    assert loaded.note == ""
    x, y, documents = loaded.train.batch(global_batch=4, seed=0, step=0)
    assert x.shape == y.shape == documents.shape == (4, 2 * longest)
    assert (documents.diff(dim=1) >= 0).all() and (documents[:, 0] == 0).all()
    trained = y != IGNORE_INDEX
    assert 0 < trained.sum() < trained.numel()
    for row in range(4):  # every window holds whole conversations: each opens with <|im_start|>
        starts = torch.nonzero(documents[row].diff() > 0).flatten() + 1
        pad = x.shape[1] if (x[row] == loaded.train.pad_id).sum() == 0 else int(starts[-1])
        for at in [0, *starts.tolist()]:
            if at < pad:
                assert HFTokenizer(str(folder / "tokenizer.json")).decode([int(x[row, at])]) == "<|im_start|>"


def test_a_conversation_longer_than_a_window_is_cut_and_counted(folder, tmp_path):
    data = chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 4)
    out = tmp_path / "out"
    prepare(PrepareOptions((str(data),), str(folder), str(out), chat=True, val_fraction=0.25), io.StringIO())
    first = len(_renderer(folder).encode(CONVERSATIONS[0], "")[0])
    others = max(len(_renderer(folder).encode(c, "")[0]) for c in CONVERSATIONS[1:])
    loaded = TokenData.load(str(out), seq_len=max(others, first // 2))
    assert loaded.note.startswith("4 conversation(s)") and "cut" in loaded.note


def test_train_on_without_chat_is_refused_in_one_line(tmp_path, capsys):
    from trainmesh.app.cli import main

    text = tmp_path / "a.txt"
    text.write_text("hello")
    assert main(["prepare", "--input", str(text), "--tokenizer", "tok.json", "--out", str(tmp_path / "out"),
                 "--train-on", "all"]) == 2
    assert "--train-on all chooses the trained tokens of chat data; add --chat" in capsys.readouterr().err


def test_altered_labels_or_an_index_without_them_are_refused_in_one_line(folder, tmp_path):
    data = chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 4)
    out = tmp_path / "out"
    index = prepare(PrepareOptions((str(data),), str(folder), str(out), chat=True, val_fraction=0.25), io.StringIO())
    labels = out / index.shards[0].labels_file
    labels.write_bytes(bytes([TRAINED]) + labels.read_bytes()[1:])
    with pytest.raises(DataError, match=r"train-00000.labels: SHA-256 does not match index.json"):
        TokenData.load(str(out), seq_len=64, verify=True)
    raw = json.loads((out / "index.json").read_text())
    del raw["shards"][0]["labels_sha256"]
    (out / "index.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match="labels_sha256 must be listed for every shard of chat data"):
        read_index(str(out))
