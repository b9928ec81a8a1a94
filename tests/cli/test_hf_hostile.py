"""Hostile and careless Hugging Face model folders (``train --init-hf``, ``trainmesh.models.hf``): nothing in
one executes, weights that cannot train are refused naming the tensor, config sizes that are not whole
numbers in range are refused naming the key, and a fuzzer mutates ``config.json`` and the safetensors
header of tiny GPT-2 and Llama folders written by ``save_pretrained``: each mutant loads correctly or is
refused in one line (:class:`~trainmesh.models.hf.HFError`, which the CLI prints as one line), never
another exception, never a hang (docs/reliability.md)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainmesh.app import checkpoints
from trainmesh.app.cli import main
from trainmesh.app.config import Config
from trainmesh.checkpoint import CheckpointError
from trainmesh.models import hf

from fuzz import CaseTimeout, deadline

transformers = pytest.importorskip("transformers")

EVIL = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import GPT2Config as EvilConfig\n"


def _save(model_class, cfg, directory: Path) -> Path:
    torch.manual_seed(0)
    model_class(cfg).save_pretrained(directory)
    (directory / "generation_config.json").unlink(missing_ok=True)
    return directory


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random GPT-2 and Llama as ``save_pretrained`` writes them (a few KB each), of the byte
    tokenizer's vocabulary so that `train --init-hf` reaches the checks on the folder itself."""
    root = tmp_path_factory.mktemp("hf")
    gpt2 = transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                   bos_token_id=None, eos_token_id=None)
    llama = transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                     bos_token_id=None, eos_token_id=None)
    return {"gpt2": _save(transformers.GPT2LMHeadModel, gpt2, root / "gpt2"),
            "llama": _save(transformers.LlamaForCausalLM, llama, root / "llama")}


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def _edit_config(directory: Path, **changes) -> Path:
    config = json.loads((directory / hf.CONFIG).read_text())
    config.update(changes)
    (directory / hf.CONFIG).write_text(json.dumps(config))
    return directory


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainmesh: error: ") and err.count("\n") == 1, err
    return err


# --- nothing from a model folder executes ------------------------------------------------------------------

@pytest.mark.parametrize("with_model_type", [False, True])
def test_a_folder_with_auto_map_runs_no_code_and_reads_no_stdin(folders, tmp_path, capsys, monkeypatch,
                                                                  with_model_type):
    """``auto_map`` points transformers at ``evil.py``; without ``model_type`` transformers would ask on the
    terminal and, with "y" on stdin, run it. Refused in one line naming it, before transformers is called,
    with "y" waiting on stdin (a pipe): the marker evil.py would write never appears, nothing waits."""
    marker = tmp_path / "evil-ran"
    directory = _edit_config(_copy(folders["gpt2"], tmp_path / "evil"),
                             auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    if not with_model_type:
        config = json.loads((directory / hf.CONFIG).read_text())
        del config["model_type"]
        (directory / hf.CONFIG).write_text(json.dumps(config))
    (directory / "evil.py").write_text(EVIL.format(marker=str(marker)))
    read, write = os.pipe()
    os.write(write, b"y\ny\n")
    os.close(write)
    monkeypatch.setattr(sys, "stdin", os.fdopen(read))
    start = time.monotonic()
    err = _one_line_error(capsys, ["train", "--init-hf", str(directory), "--steps", "1"])
    assert f"{directory}/config.json has auto_map, which would run Python code from the model folder (evil.py)" in err
    for api in (hf.read_config, hf.check_weights, hf.read_hf):
        with pytest.raises(hf.HFError, match="has auto_map"):
            api(directory)
    assert time.monotonic() - start < 5
    assert not marker.exists() and "evil" not in sys.modules
    assert sys.stdin.read() == "y\ny\n", "something read stdin"


# --- weights that cannot train -------------------------------------------------------------------------------

@pytest.mark.parametrize("poison", ["nan", "inf", "uint8", "int64"])
def test_initial_weights_that_cannot_train_are_refused_naming_the_tensor(folders, tmp_path, capsys, poison):
    """In an ``--init-hf`` folder (before any rank starts, and through the Python API) and in an
    ``--init-from`` file: NaN/inf would train ``loss nan -> nan``, integers are no weights."""
    name = "transformer.h.0.mlp.c_fc.weight"
    tensors = load_file(folders["gpt2"] / hf.WEIGHTS)
    if poison in ("nan", "inf"):
        tensors[name][1, 2] = float(poison)
        expect = f"tensor {name} holds 1 non-finite value(s) (NaN or inf)"
    else:
        tensors[name] = tensors[name].to(getattr(torch, poison))
        expect = f"tensor {name} is {'U8' if poison == 'uint8' else 'I64'}; initial weights must be floating point"
    directory = _copy(folders["gpt2"], tmp_path / "poisoned")
    save_file(tensors, directory / hf.WEIGHTS, metadata={"format": "pt"})
    assert expect in _one_line_error(capsys, ["train", "--init-hf", str(directory)])
    if poison in ("nan", "inf"):  # the header of an integer tensor is refused before its data is read
        with pytest.raises(hf.HFError, match=expect.replace("(", r"\(").replace(")", r"\)")):
            hf.read_hf(directory)
    ours = tmp_path / "weights.safetensors"
    save_file({"embed.weight": tensors[name]}, ours)
    with pytest.raises(CheckpointError, match="^--init-from .*: tensor embed.weight (holds 1 non-finite|is )"):
        checkpoints.check_resumable(Config.from_settings(init_from=str(ours)))


# --- config sizes ----------------------------------------------------------------------------------------------

CONFIG_CASES = [("gpt2", "n_layer", 2.5, "n_layer is 2.5; it must be a whole number from 1 to 2,147,483,647"),
                ("gpt2", "n_positions", -1, "n_positions is -1; it must be a whole number from 1 to 1,048,576"),
                ("gpt2", "n_head", 0, "n_head is 0; it must be a whole number from 1"),
                ("gpt2", "vocab_size", True, "vocab_size is true; it must be a whole number"),
                ("gpt2", "layer_norm_epsilon", "1e-5", 'layer_norm_epsilon is "1e-5"; it must be a positive finite'),
                ("llama", "max_position_embeddings", 2**40, "max_position_embeddings is 1099511627776; it must be"),
                ("llama", "num_key_value_heads", "2", 'num_key_value_heads is "2"; it must be a whole number'),
                ("llama", "rope_theta", -1.0, "rope_theta is -1.0; it must be a positive finite number")]


@pytest.mark.parametrize("family,key,value,message", CONFIG_CASES, ids=[f"{k}={v}" for _, k, v, _ in CONFIG_CASES])
def test_config_sizes_that_are_no_whole_numbers_in_range_are_one_line_naming_the_key(folders, tmp_path, capsys,
                                                                                     family, key, value, message):
    directory = _edit_config(_copy(folders[family], tmp_path / family), **{key: value})
    assert f"{directory}/config.json: {message}" in _one_line_error(capsys, ["train", "--init-hf", str(directory)])


SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, bos_token_id=None,
             eos_token_id=None)


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen2, Mistral (a window of 4), Qwen3-MoE (four experts, a dense first layer) and
    DeepSeek-V3 (latent attention, four routed experts and one shared) folders."""
    root = tmp_path_factory.mktemp("families")
    configs = {
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True)),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig(**SHAPE, sliding_window=4)),
        "qwen3-moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **SHAPE, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[0])),
        "deepseek-v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
            **{**SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=12)),
    }
    return {name: _save(model_class, cfg, root / name) for name, (model_class, cfg) in configs.items()}


ROPE = "rope_parameters"
FAMILY_CASES = [
    ("qwen3-moe", "moe_intermediate_size", 0, "moe_intermediate_size is 0; it must be a whole number from 1 to"),
    ("qwen3-moe", "moe_intermediate_size", -32, "moe_intermediate_size is -32; it must be a whole number from 1"),
    ("deepseek-v3", "kv_lora_rank", -16, "kv_lora_rank is -16; it must be a whole number from 1 to 2,147,483,647"),
    ("deepseek-v3", "n_shared_experts", -1, "n_shared_experts is -1; it must be a whole number from 0 to 4,096, or null"),
    ("deepseek-v3", "routed_scaling_factor", math.nan, "routed_scaling_factor is NaN; it must be a positive finite"),
    ("qwen2", ROPE, {"rope_theta": -1, "rope_type": "default"}, "rope_parameters.rope_theta is -1; it must be a "
                                                                "positive finite number"),
    ("qwen2", ROPE, {"rope_theta": math.nan, "rope_type": "default"}, "rope_parameters.rope_theta is NaN"),
    ("qwen2", ROPE, {"rope_theta": 0, "rope_type": "default"}, "rope_parameters.rope_theta is 0"),
    ("qwen2", "rope_scaling", {"rope_type": "linear", "factor": math.inf}, "rope_scaling.factor is Infinity; it must "
                                                                           "be a finite number"),
    ("mistral", "sliding_window", -5, "sliding_window is -5; it must be a whole number from 1 to 2,147,483,647, or null"),
    ("mistral", "sliding_window", 0, "sliding_window is 0; it must be a whole number from 1"),
    ("qwen3-moe", "num_local_experts", INT32_MAX := 2**31 - 1, "num_local_experts is 2147483647; it must be a whole "
                                                               "number from 1 to 4,096"),
]


@pytest.mark.parametrize("family,key,value,message", FAMILY_CASES,
                         ids=[f"{f}-{k}={json.dumps(v)}" for f, k, v, _ in FAMILY_CASES])
def test_moe_mla_rope_and_window_settings_out_of_range_are_one_line_naming_the_key(family_folders, tmp_path, capsys,
                                                                                  family, key, value, message):
    """Issue #46, cases 7, 8, 13 and 14: an expert width of 0 (a ZeroDivisionError in moe.py), negative
    latent ranks and shared-expert counts (negative tensor dimensions), a rope base of -1, NaN or 0 wherever
    it sits (imported, then NaN in every forward pass), a window of -5 (every key masked) or 0 (which became
    full attention), 2**31 - 1 experts (a name list that took minutes): each refused in one line naming the
    file and key, before any tensor is built, through the CLI and through ``check_weights``."""
    directory = _edit_config(_copy(family_folders[family], tmp_path / family), **{key: value})
    assert f"{directory}/config.json: {message}" in _one_line_error(capsys, ["train", "--init-hf", str(directory)])
    with deadline(5):
        with pytest.raises(hf.HFError, match="^" + re.escape(f"{directory}/config.json: {message}")):
            hf.check_weights(directory)


def test_each_family_loads_with_its_settings_in_range(family_folders):
    """What the bounds keep: the tiny folders as written (null windows and query ranks included) load."""
    for family, directory in family_folders.items():
        hf.check_weights(directory)
    assert hf.read_config(family_folders["mistral"])[1].sliding_window == 4


def test_a_model_too_large_for_this_machine_is_named_by_its_folder_not_a_preset(family_folders, tmp_path, capsys):
    """Issue #46, case 14: an ``--init-hf`` model whose state exceeds this machine's memory was refused as
    ``--model qwen3-moe-tiny``, a flag the user never passed; the line names the folder."""
    directory = _edit_config(_copy(family_folders["qwen3-moe"], tmp_path / "huge"), moe_intermediate_size=INT32_MAX)
    err = _one_line_error(capsys, ["train", "--init-hf", str(directory), "--steps", "1"])
    assert f"--init-hf {directory} at this layout needs" in err and "--model" not in err, err
    assert f"see trainmesh plan --init-hf {directory}" in err


def test_a_run_that_diverges_ends_in_its_one_line(tmp_path, capfd, monkeypatch):
    """Issue #46, case 8: :class:`~trainmesh.app.train.TrainingDiverged` (NaN gradients from the first step
    on) reached the user as an 18-line traceback; its own message says what to do, as one line, exit 2
    (``capfd``: the rank registers faulthandler on stderr's file descriptor)."""
    monkeypatch.setenv("TRAINMESH_FAULT", "nan@0:*")
    err = _one_line_error(capfd, ["train", "--model", "tiny", "--steps", "6", "--max-bad-steps", "2",
                                   "--out", str(tmp_path / "run")])
    assert "2 consecutive steps up to step 2 had a non-finite loss or gradient" in err and "Lower --lr" in err


# --- the fuzzer ----------------------------------------------------------------------------------------------

HOSTILE = [None, True, False, -1, 0, 1, 2, 3, 7, 2**31, 2**63, 1e308, -1.5, 2.5, float("nan"), float("inf"), "",
           "gpt2", "llama", "mixtral", "F32", [], [0], ["GPT2LMHeadModel"], ["LlamaForCausalLM"], {}, {"a": 1},
           {"AutoConfig": "evil.EvilConfig"}, {"rope_type": "linear", "factor": 2.0}, "a\nb"]
DTYPES = ["F32", "F16", "BF16", "F64", "U8", "I64", "BOOL", "F8_E4M3", "XX", 1]
NAN_F32 = struct.pack("<f", math.nan)


def _mutate_config(rng: random.Random, text: str) -> tuple[bytes, str]:
    """``config.json`` with one mutation: a key set to a hostile value, nudged, removed or added, the file
    nested deeply, or its bytes flipped or cut."""
    how = rng.random()
    if how < 0.08:
        data = bytearray(text.encode())
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        return (bytes(data) if rng.random() < 0.5 else bytes(data[:i])), "raw bytes"
    if how < 0.1:
        return b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"
    config = json.loads(text)
    key = rng.choice([*config, *hf.SIZES, *hf.SCALES, "auto_map", "model_type", "architectures", "rope_scaling"])
    if how < 0.6:
        config[key] = rng.choice(HOSTILE)
    elif how < 0.8 and isinstance(config.get(key), int):
        config[key] = config[key] + rng.choice([-config[key], -1, 1, config[key], 2**20])
    else:
        config.pop(key, None)
    return json.dumps(config).encode(), f"{key}={json.dumps(config.get(key))[:30]}"


def _mutate_weights(rng: random.Random, shard: bytes) -> tuple[bytes, str]:
    """The safetensors file with one mutation of its header (a tensor's dtype, shape, offsets or name; a
    tensor dropped; the header's length; a flipped bit) or of its data (a NaN written into a tensor)."""
    n = struct.unpack("<Q", shard[:8])[0]
    header, body = json.loads(shard[8:8 + n]), shard[8 + n:]
    name = rng.choice([k for k in header if k != "__metadata__"])
    how = rng.random()
    if how < 0.1:
        return struct.pack("<Q", rng.choice([0, n - 1, n + 1, 2**40, 2**64 - 1])) + shard[8:], "header length"
    if how < 0.2:
        data = bytearray(shard)
        data[8 + rng.randrange(n)] ^= 1 << rng.randrange(8)
        return bytes(data), "header bit"
    if how < 0.35 and header[name]["dtype"] == "F32":
        start = header[name]["data_offsets"][0] + 4 * rng.randrange(max(1, math.prod(header[name]["shape"])))
        return shard[:8 + n + start] + NAN_F32 + shard[8 + n + start + 4:], f"NaN in {name}"
    if how < 0.55:
        header[name]["dtype"] = rng.choice(DTYPES)
    elif how < 0.7:
        header[name]["shape"] = rng.choice([[], [0], [1], [-1], [2**40], ["1"], None, header[name]["shape"][::-1],
                                            [*header[name]["shape"], 1]])
    elif how < 0.8:
        start, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice([[end, start], [start, end + 4], [0, 2**62], [start], "x"])
    elif how < 0.9:
        header[rng.choice(["lm_head.weight", "extra", name + ".x", ""])] = header.pop(name)
    else:
        del header[name]
    new = json.dumps(header).encode()
    return struct.pack("<Q", len(new)) + new + body, f"{name}: {json.dumps(header.get(name))[:60]}"


def _check_loaded(directory: Path, label: str) -> None:
    """A mutant that loads: its weights are finite floats that fit the model its config describes."""
    spec, cfg = hf.check_weights(directory)
    _, _, weights = hf.read_hf(directory)
    model = spec.builder(cfg, 0)
    for name, p in model.named_parameters():
        assert name in weights and weights[name].shape == p.shape, f"{label}: {name} does not fit"
        assert weights[name].is_floating_point() and torch.isfinite(weights[name]).all(), label



def _tally(outcomes: dict, label: str, directory: Path, seconds: float, check) -> None:
    """Run one fuzzed case under a deadline: it loads, or is refused in one line naming its folder."""
    try:
        with deadline(seconds):
            check()
    except CaseTimeout:
        pytest.fail(f"{label} hung")
    except hf.HFError as e:
        assert "\n" not in str(e) and str(directory) in str(e), f"{label}: {e!r}"
        outcomes["refused"] += 1
    else:
        outcomes["loaded"] += 1


def _trains_finitely(directory: Path, label: str, tokens: torch.Tensor) -> None:
    _check_loaded(directory, label)
    spec, cfg, weights = hf.read_hf(directory)
    model = spec.builder(cfg, 0)
    model.load_state_dict(weights, strict=False)
    assert torch.isfinite(model(tokens)).all(), f"{label}: the forward pass is not finite"

@pytest.mark.timeout(120)
def test_fuzzed_config_and_safetensors_headers_load_correctly_or_fail_in_one_line(folders, tmp_path):
    """1,050 mutants of the two folders (700 of config.json, 350 of the safetensors file), each through the
    loader ``train --init-hf`` uses (``check_weights`` before the ranks start, ``read_hf`` in them)."""
    rng = random.Random(33)
    outcomes = {"loaded": 0, "refused": 0}
    start = time.monotonic()
    fixed = {family: _copy(source, tmp_path / f"weights-{family}") for family, source in folders.items()}
    for case in range(1050):
        family = "gpt2" if case % 2 else "llama"
        if case % 3 == 2:  # the config stays, so it is read once per folder (read_config's cache)
            directory = fixed[family]
            data, what = _mutate_weights(rng, (folders[family] / hf.WEIGHTS).read_bytes())
            (directory / hf.WEIGHTS).write_bytes(data)
        else:
            directory = _copy(folders[family], tmp_path / f"case-{case}")
            data, what = _mutate_config(rng, (folders[family] / hf.CONFIG).read_text())
            (directory / hf.CONFIG).write_bytes(data)
        label = f"case {case} ({family}: {what})"
        _tally(outcomes, label, directory, 5, lambda: _check_loaded(directory, label))
    elapsed = time.monotonic() - start
    print(f"HF folder fuzzer: {outcomes} in {elapsed:.1f} s")
    assert outcomes["refused"] > 500 and outcomes["loaded"] > 50, outcomes


NUMBERS = [0, -1, -32, 2**31, 2**63, 1e308, math.nan, math.inf, -math.inf, 2.5, "8", True, None, [4]]


def _numeric_keys(config: dict, prefix: str = "") -> list[str]:
    """Every key of ``config`` holding a number (dotted into nested dicts: ``rope_parameters.rope_theta``)."""
    keys = []
    for key, value in config.items():
        if isinstance(value, dict):
            keys += _numeric_keys(value, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            keys.append(prefix + key)
    return keys


def _set(config: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for key in path:
        config = config[key]
    config[last] = value


@pytest.mark.timeout(300)
def test_every_numeric_moe_and_mla_setting_mutated_imports_correctly_or_fails_in_one_line(family_folders, tmp_path):
    """Issue #46: every number in the Qwen3-MoE and DeepSeek-V3 configs (nested rope settings included)
    set in turn to 0, negative, huge, NaN, infinite, fractional, a string, a bool, null and a list: each
    import through ``check_weights`` either loads weights that fit a model whose forward pass is finite,
    or is one line naming the folder; never another exception, never a hang."""
    outcomes = {"loaded": 0, "refused": 0}
    start = time.monotonic()
    tokens = torch.arange(8).reshape(1, 8)
    for family in ("qwen3-moe", "deepseek-v3"):
        original = json.loads((family_folders[family] / hf.CONFIG).read_text())
        for key in _numeric_keys(original):
            for i, value in enumerate(NUMBERS):
                config = json.loads(json.dumps(original))
                _set(config, key, value)
                directory = tmp_path / f"{family}-{key}-{i}"
                shutil.copytree(family_folders[family], directory)
                (directory / hf.CONFIG).write_text(json.dumps(config))
                label = f"{family} {key}={json.dumps(value)}"
                _tally(outcomes, label, directory, 10, lambda: _trains_finitely(directory, label, tokens))
    elapsed = time.monotonic() - start
    print(f"MoE/MLA config fuzzer: {outcomes} in {elapsed:.1f} s")
    assert outcomes["refused"] > 300 and outcomes["loaded"] > 20, outcomes

