"""docs/data.md's supervised fine-tuning walk-through, offline: a chat JSONL -> ``prepare --chat`` with a tokenizer
folder holding a chat template -> ``train --init-hf`` -> ``export --hf`` -> transformers' ``apply_chat_template`` +
``generate`` give the same greedy tokens as ``trainmesh generate --chat``."""

from __future__ import annotations

import json

import pytest
import torch

from trainmesh.app.cli import main
from trainmesh.checkpoint import read_manifest
from trainmesh.app.generate import GREEDY, chat_prompt, checkpoint_path, generate, load_model, tokenizer_of

from helpers import CONVERSATIONS, chat_jsonl, chat_tokenizer

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
QUESTION = "Say hello."


def _model_folder(folder):
    """The tokenizer folder made a Hugging Face model folder: a tiny random Llama saved beside the tokenizer,
    which stops at ``<|im_end|>``."""
    chat_tokenizer(folder)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=5000.0, rms_norm_eps=1e-6, initializer_range=0.2,
                                   eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def _hf_reply(out) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return generated[0, ids.shape[1]:].tolist()


def test_sft_walkthrough_chats_in_transformers_as_in_trainmesh(tmp_path, capfd):
    model = _model_folder(tmp_path / "model")
    chat = chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 8)
    data, ckpt, run, out = (tmp_path / name for name in ("data", "ckpt", "run", "export"))
    assert main(["prepare", "--chat", "--input", str(chat), "--tokenizer", str(model), "--out", str(data),
                 "--val-fraction", "0.25"]) == 0
    assert main(["train", "--init-hf", str(model), "--data", str(data), "--document-mask", "--steps", "3",
                 "--global-batch", "2", "--seq-len", "64", "--lr", "1e-3", "--checkpoint-dir", str(ckpt), "--no-progress",
                 "--out", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r["trained_tokens"] for r in records if "trained_tokens" in r]
    assert len(trained) == 3 and all(0 < n < 2 * 64 for n in trained)
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    assert "{% for message in messages %}" in json.dumps(json.loads((out / "tokenizer_config.json").read_text()))

    capfd.readouterr()
    assert main(["generate", "--checkpoint-dir", str(ckpt), "--chat", "--prompt", QUESTION, "--temperature", "0",
                 "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu"]) == 0
    printed = capfd.readouterr().out
    path = checkpoint_path(ckpt, None)
    plain, manifest = load_model(path, torch.device("cpu"))
    tok, _ = tokenizer_of(manifest, path, None)
    ours = generate(plain, tok.encode(chat_prompt(manifest, path, QUESTION)), NEW_TOKENS, 64, GREEDY, tok.vocab_size)
    assert printed == tok.decode(ours) + "\n"
    theirs = _hf_reply(out)
    if len(theirs) < NEW_TOKENS:  # transformers stopped at the end-of-turn token; trainmesh generates on
        assert theirs[-1] == tok.encode("<|im_end|>")[0]
    assert ours[:len(theirs)] == theirs


def test_a_run_from_scratch_on_chat_data_keeps_the_data_s_chat_template(tmp_path, capfd):
    """No --init-hf: the checkpoint keeps the tokenizer files prepare kept with the chat data, so the export holds
    the template and generate --chat renders with it; conversations longer than a window are said once."""
    folder = chat_tokenizer(tmp_path / "tok")
    chat = chat_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS * 8)
    data, ckpt, out = tmp_path / "data", tmp_path / "ckpt", tmp_path / "export"
    assert main(["prepare", "--chat", "--input", str(chat), "--tokenizer", str(folder), "--out", str(data)]) == 0
    capfd.readouterr()
    assert main(["train", "--model", "llama-tiny", "--data", str(data), "--steps", "1", "--global-batch", "2",
                 "--seq-len", "16", "--checkpoint-dir", str(ckpt), "--no-progress", "--out", str(tmp_path / "run")]) == 0
    said = capfd.readouterr().err
    assert said.count("are longer than a window of seq_len + 1 = 17 tokens; each is cut") == 1, said
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(out)
    assert exported.chat_template == transformers.PreTrainedTokenizerFast.from_pretrained(folder).chat_template
    path = checkpoint_path(ckpt, None)
    manifest = read_manifest(path)
    assert chat_prompt(manifest, path, QUESTION) == exported.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
