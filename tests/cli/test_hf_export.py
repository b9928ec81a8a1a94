"""Exports that load as they came in: ``trainmesh export CKPT --hf OUT`` writes, besides the weights, the run's
tokenizer as Hugging Face tokenizer files, its special token ids and a generation config, so that
``AutoTokenizer`` and ``AutoModelForCausalLM`` from OUT continue a prompt with the same greedy tokens as
``trainmesh generate``; an ``--init-hf`` run keeps what its source directory held (its chat template); a
model vocabulary smaller than the data's tokenizer is refused, a larger one said once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_hf import save_hf_llama
from trainmesh.app.cli import main
from trainmesh.app.generate import GREEDY, generate_text
from trainmesh.data.tokenizer import tokenizer_vocab_size

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPT = "def main():\n    "


def _hf_greedy(out: Path, prompt: str, new: int) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=new, do_sample=False)
    return tok.decode(generated[0, ids.shape[1]:])


def test_an_exported_byte_model_generates_in_transformers_as_trainmesh_generate(tmp_path, capfd):
    ckpt, docs = tmp_path / "ckpt", tmp_path / "docs.txt"
    docs.write_text("def main():\n    return 0\n" * 50)
    assert main(["train", "--model", "llama-tiny", "--data", str(docs), "--steps", "2", "--global-batch", "2",
                 "--checkpoint-dir", str(ckpt), "--no-progress", "--out", str(tmp_path / "run")]) == 0
    out = tmp_path / "not" / "yet" / "there"
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    assert "tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json" in \
        capfd.readouterr().out
    ours = generate_text(str(ckpt), PROMPT, 12, GREEDY, device="cpu")
    assert _hf_greedy(out, PROMPT, 12) == ours
    assert transformers.AutoTokenizer.from_pretrained(out)("é")["input_ids"] == list("é".encode())


@pytest.mark.slow
def test_an_init_hf_run_exports_its_sources_tokenizer_chat_template_and_token_ids(tmp_path, capfd):
    """A BPE of up to 300 tokens for a 320-token model: accepted, said once; the source's tokenizer files and
    its ids come back."""
    docs = tmp_path / "docs.txt"
    docs.write_text("def main():\n    return 0\n" * 200)
    source = tmp_path / "source"
    source.mkdir()
    assert main(["tokenizer", "train", "--input", str(docs), "--vocab-size", "300",
                 "--out", str(source / "tokenizer.json")]) == 0
    _save_llama(source, vocab=320, eos=0)
    (source / "chat_template.jinja").write_text("{{ messages }}")
    ckpt = tmp_path / "ckpt"
    args = ["train", "--init-hf", str(source), "--data", str(docs), "--tokenizer", str(source / "tokenizer.json"),
            "--steps", "2", "--global-batch", "2", "--seq-len", "32", "--checkpoint-dir", str(ckpt), "--no-progress",
            "--out", str(tmp_path / "run")]
    capfd.readouterr()
    assert main(args) == 0
    said = capfd.readouterr()
    tokens = tokenizer_vocab_size(str(source / "tokenizer.json"))  # at most 300: the corpus may give fewer merges
    assert (said.out + said.err).count(f"the model's vocabulary of 320 exceeds the tokenizer's {tokens}") == 1
    out = tmp_path / "out"
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == 0


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused_in_one_line(tmp_path, capfd):
    docs = tmp_path / "docs.txt"
    docs.write_text("def main():\n    return 0\n" * 50)
    tok = tmp_path / "tokenizer.json"
    assert main(["tokenizer", "train", "--input", str(docs), "--vocab-size", "270", "--out", str(tok)]) == 0
    tokens = tokenizer_vocab_size(str(tok))
    _save_llama(tmp_path / "small", vocab=tokens - 1, eos=0)
    capfd.readouterr()
    assert main(["train", "--init-hf", str(tmp_path / "small"), "--data", str(docs), "--tokenizer", str(tok)]) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1].endswith(
        f"vocabulary of {tokens - 1} tokens but the data's tokenizer ({tok}) has {tokens}; train with the model's "
        f"own tokenizer (--tokenizer {tmp_path / 'small'}/tokenizer.json)")


def _save_llama(directory: Path, vocab: int, eos: int) -> None:
    """The tiny random Llama of ``test_hf``, with another vocabulary and an end-of-text id."""
    save_hf_llama(directory)
    config = json.loads((directory / "config.json").read_text())
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, "vocab_size": vocab,
                                                                      "eos_token_id": eos}))
    model.save_pretrained(directory)
