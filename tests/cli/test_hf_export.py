"""Exports that load as they came in: ``trainmesh export CKPT --hf OUT`` writes, besides the weights, the run's
tokenizer as Hugging Face tokenizer files, its special token ids and a generation config, so that
``AutoTokenizer`` and ``AutoModelForCausalLM`` from OUT continue a prompt with the same greedy tokens as
``trainmesh generate``; an ``--init-hf`` run keeps what its source directory held (its chat template); a
model vocabulary smaller than the data's tokenizer is refused, a larger one said once."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fuzz import deadline
from test_hf import save_hf_llama
from trainmesh.app.cli import main
from trainmesh.app.generate import GREEDY, generate_text
from trainmesh.checkpoint import candidates
from trainmesh.checkpoint.store import content_hash
from trainmesh.storage.safe_io import sha256_hex
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


# --- hostile and careless input (issue 46): an export holds only what the checkpoint holds ----------------

def _secrets(tmp_path: Path) -> Path:
    """A folder a tamperer would like exported: a private key (0600), credentials, a valid tokenizer."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (secrets / "id_rsa").chmod(0o600)
    (secrets / "credentials").write_text("[default]\naws_secret_access_key = x\n")
    (secrets / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    return secrets


@pytest.fixture(scope="module")
def init_hf_run(tmp_path_factory, tok) -> tuple[Path, Path]:
    """An ``--init-hf`` run (1 step, its source's own tokenizer) whose source holds a chat template, a 0600
    file and ``README.md``, a link to a private key: the source and the checkpoint directory."""
    root = tmp_path_factory.mktemp("init_hf")
    docs, source = root / "docs.txt", root / "source"
    docs.write_text("def main():\n    return 0\n" * 50)
    source.mkdir()
    (source / "tokenizer.json").write_bytes(Path(tok).read_bytes())
    _save_llama(source, vocab=320, eos=0)
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "notes.txt").write_text("the team's notes")
    (source / "notes.txt").chmod(0o600)
    key = root / "id_rsa"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o600)
    (source / "README.md").symlink_to(key)
    ckpt = root / "ckpt"
    assert main(["train", "--init-hf", str(source), "--data", str(docs), "--tokenizer", str(source / "tokenizer.json"),
                 "--steps", "1", "--global-batch", "2", "--seq-len", "32", "--checkpoint-dir", str(ckpt),
                 "--no-progress", "--out", str(root / "run")]) == 0
    return source, ckpt


SEEN: list[str] | None = None


def _audit(event: str, args) -> None:
    if SEEN is not None and event in ("open", "os.scandir", "os.listdir") and args and \
            isinstance(args[0], (str, bytes, os.PathLike)):
        SEEN.append(os.path.abspath(os.fsdecode(args[0])))


@contextlib.contextmanager
def _watching() -> Iterator[list[str]]:
    """Every file opened and directory listed in the block (an audit hook, installed once)."""
    global SEEN
    if not hasattr(_watching, "installed"):
        sys.addaudithook(_audit)
        _watching.installed = True
    SEEN = []
    try:
        yield SEEN
    finally:
        SEEN = None


def test_an_init_hf_source_keeps_regular_files_only_and_exports_them_from_the_checkpoint(init_hf_run, tmp_path,
                                                                                        capfd):
    """Case 2: ``README.md -> id_rsa`` in the source is skipped at save time, never followed; the export
    takes the source's files from the checkpoint, a 0600 one staying 0600, with the source moved away."""
    source, ckpt = init_hf_run
    moved = tmp_path / "moved"
    source.rename(moved)
    try:
        out = tmp_path / "out"
        assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    finally:
        moved.rename(source)
    said = capfd.readouterr().out
    assert "README.md" not in said and not (out / "README.md").exists()
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert oct((out / "notes.txt").stat().st_mode & 0o777) == oct(0o600)
    assert all((p.stat().st_mode & 0o777) <= 0o644 for p in out.iterdir())
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0


def test_the_skipped_link_is_said_once_when_the_run_saves(tmp_path, capfd, tok):
    source, docs = tmp_path / "source", tmp_path / "docs.txt"
    docs.write_text("def main():\n    return 0\n" * 50)
    save_hf_llama(source)
    (source / "README.md").symlink_to(tmp_path / "id_rsa")
    (tmp_path / "id_rsa").write_text("key")
    assert main(["train", "--init-hf", str(source), "--data", str(docs), "--steps", "2", "--global-batch", "2",
                 "--seq-len", "32", "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--no-progress", "--out", str(tmp_path / "run")]) == 0
    said = capfd.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "README.md" in line]
    assert len(lines) == 1 and "README.md (a symbolic link)" in lines[0] and "never through a link" in lines[0], lines
    assert not list((tmp_path / "ckpt").glob("step-*/hf-README.md"))


def test_an_export_never_reads_a_folder_a_rehashed_manifest_names(init_hf_run, tmp_path, capfd):
    """Case 1: ``config.checkpoint.init_hf`` (and the tokenizer's recorded source) re-pointed at a folder holding
    ``id_rsa`` and ``credentials``, the manifest re-hashed: the export is the checkpoint's, nothing of that
    folder is read or written."""
    source, ckpt = init_hf_run
    secrets = _secrets(tmp_path)
    forged = tmp_path / "ckpt"
    shutil.copytree(ckpt, forged, symlinks=True)
    step = candidates(forged)[0]
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["config"].update(init_hf=str(secrets), tokenizer=str(secrets / "id_rsa"), data=str(secrets))
    manifest["tokenizer"]["source"] = str(secrets / "id_rsa")
    manifest["sha256"] = content_hash(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    with _watching() as seen:
        assert main(["export", str(forged), "--hf", str(out)]) == 0
    assert not [p for p in seen if p.startswith((str(secrets), str(source)))], seen
    said = capfd.readouterr().out
    assert "id_rsa" not in said and "credentials" not in said, said
    assert {p.name for p in out.iterdir()} == EXPORTED


EXPORTED = {"config.json", "model.safetensors", "chat_template.jinja", "notes.txt", "tokenizer.json",
            "generation_config.json"}


def test_an_export_never_replaces_the_users_files_unless_overwrite(init_hf_run, tmp_path, capfd):
    """Case 4: a folder holding the user's own tokenizer files is refused in one line naming them, nothing
    written; ``--overwrite`` replaces them and says so."""
    _, ckpt = init_hf_run
    out = tmp_path / "mine"
    out.mkdir()
    theirs = {name: f"the user's {name}" for name in ("tokenizer.json", "generation_config.json", "notes.txt")}
    for name, text in theirs.items():
        (out / name).write_text(text)
    (out / "chat_template.jinja").symlink_to(tmp_path / "elsewhere")
    capfd.readouterr()
    assert main(["export", str(ckpt), "--hf", str(out)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        f"export --hf {out} already holds chat_template.jinja, generation_config.json, notes.txt, tokenizer.json, "
        f"which the export writes; choose an empty or new directory, or pass --overwrite to replace them"), err
    assert {p.name for p in out.iterdir()} == {*theirs, "chat_template.jinja"}
    assert all((out / name).read_text() == text for name, text in theirs.items())
    assert main(["export", str(ckpt), "--hf", str(out), "--overwrite"]) == 0
    said = capfd.readouterr().out
    assert "; replaced chat_template.jinja, generation_config.json, notes.txt, tokenizer.json (--overwrite)" in said
    assert not (out / "chat_template.jinja").is_symlink() and not (tmp_path / "elsewhere").exists()
    assert {p.name for p in out.iterdir()} == EXPORTED


def test_an_export_over_a_model_is_refused_unless_overwrite(init_hf_run, tmp_path, capfd):
    _, ckpt = init_hf_run
    out = tmp_path / "out"
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    capfd.readouterr()
    assert main(["export", str(ckpt), "--hf", str(out)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("already holds a model; choose an empty or new directory, or pass "
                                             "--overwrite to replace it"), err
    assert main(["export", str(ckpt), "--hf", str(out), "--overwrite"]) == 0
    assert "replaced config.json, model.safetensors, chat_template.jinja" in capfd.readouterr().out


# --- the export fuzzer: every path-bearing manifest field, and the kept files themselves -----------------

def _path_fields(manifest: dict) -> list[tuple[dict, str]]:
    """Every (container, key) of a manifest that holds or could hold a path: every ``config.*`` field, the
    recorded sources of the tokenizer and the model, and the kept files' names (as the key to rename)."""
    return ([(manifest["config"], k) for k in manifest["config"]] + [(manifest["tokenizer"], "source"),
            (manifest["model_source"], "source")] + [(manifest["hf_files"], k) for k in manifest["hf_files"]])


def _mutate(rng: random.Random, step: Path, secrets: Path) -> str:
    """One mutation of checkpoint ``step``, re-hashed as a tamperer would (mostly); what it did."""
    manifest = json.loads((step / "manifest.json").read_text())
    hostile = [str(secrets), str(secrets / "id_rsa"), "../secrets", "../../secrets/id_rsa", "/etc/passwd",
               "/dev/zero", str(secrets / "fifo"), "", "..", ".", "a\nb", None, 1, [], {}, "x" * 300]
    container, key = rng.choice(_path_fields(manifest))
    how = rng.random()
    if container is manifest["hf_files"] and how < 0.5:  # rename a kept file, or plant a link/FIFO as it
        name = rng.choice(hostile[:11] + ["id_rsa", "credentials"])
        entry = container.pop(key)
        if isinstance(name, str) and name in ("id_rsa", "credentials"):
            data = (secrets / name).read_bytes()
            container[name] = {"sha256": sha256_hex(data), "bytes": len(data), "mode": 0o600}
            (step / f"hf-{name}").symlink_to(secrets / name)
        else:
            container[name] = entry
        what = f"hf_files {key!r} -> {name!r}"
    elif container is manifest["hf_files"] and how < 0.75:
        target = step / f"hf-{key}"
        target.unlink()
        kind = rng.choice(["link", "fifo", "dir"])
        if kind == "link":
            target.symlink_to(secrets / "id_rsa")
            data = (secrets / "id_rsa").read_bytes()
            container[key] = {"sha256": sha256_hex(data), "bytes": len(data), "mode": 0o600}
        elif kind == "fifo":
            os.mkfifo(target)
        else:
            target.mkdir()
        what = f"hf-{key} is a {kind}"
    elif container is manifest["hf_files"]:
        container[key]["mode"] = rng.choice([0o777, 0o4755, 0o666, -1, "0644", None])
        what = f"hf_files {key!r} mode {container[key]['mode']!r}"
    else:
        container[key] = rng.choice(hostile)
        what = f"{key!r} = {container[key]!r}"
    if rng.random() < 0.9:
        manifest["sha256"] = content_hash(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))
    return what


@pytest.mark.timeout(300)
def test_fuzzed_path_fields_export_only_the_checkpoints_files_or_fail_in_one_line(init_hf_run, tmp_path, capfd):
    """Mutants of every path-bearing manifest field (``config.*``, the tokenizer's and model's sources, the
    kept files' names, modes and kinds), pointed at a folder holding a private key: each exports only files
    the checkpoint holds, with modes at most 0644, or fails in one line; none reads outside the checkpoint."""
    source, ckpt = init_hf_run
    secrets = _secrets(tmp_path)
    os.mkfifo(secrets / "fifo")
    pristine = candidates(ckpt)[0]
    secret_bytes = {(secrets / name).read_bytes() for name in ("id_rsa", "credentials")}
    rng = random.Random(46)
    outcomes = {"exported": 0, "refused": 0}
    start = time.monotonic()
    for case in range(300):
        step = tmp_path / "ckpt" / pristine.name
        shutil.rmtree(step.parent, ignore_errors=True)
        shutil.copytree(pristine, step, symlinks=True)
        what = _mutate(rng, step, secrets)
        out = tmp_path / f"out-{case}"
        capfd.readouterr()
        with deadline(10), _watching() as seen:
            code = main(["export", str(step), "--hf", str(out)])
        said = capfd.readouterr()
        label = f"case {case} ({what})"
        strays = [p for p in seen if p.startswith(str(tmp_path)) and not p.startswith((str(step), str(out)))
                  or p.startswith(str(source))]
        assert not strays, f"{label} read {strays}"
        if code == 0:
            files = {p.name: p for p in out.iterdir()}
            assert set(files) <= EXPORTED | {"tokenizer_config.json", "special_tokens_map.json"}, f"{label}: {files}"
            assert all(p.is_file() and not p.is_symlink() and p.stat().st_mode & 0o777 <= 0o644
                       and p.read_bytes() not in secret_bytes for p in files.values()), label
            outcomes["exported"] += 1
        else:
            lines = said.err.strip().splitlines()
            assert code == 2 and len(lines) == 1, f"{label}: {said.err}"
            outcomes["refused"] += 1
        shutil.rmtree(out, ignore_errors=True)
    elapsed = time.monotonic() - start
    print(f"export fuzzer: {outcomes} in {elapsed:.1f} s")
    assert outcomes["refused"] > 30 and outcomes["exported"] > 30, outcomes
