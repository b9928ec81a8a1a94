"""Hostile and careless ``trainmesh plan`` command lines (issue #46, cases 9 and 10): every number is finite
and in its stated range, ``--gpus`` is bounded and the search is time-bounded, ``--slurm`` names a regular
file it can write, nothing is silently rewritten; and a fuzzer mutates the flags of a few small plans:
each mutant prints a plan or one line on stderr with exit 2, never a traceback, never a hang."""

from __future__ import annotations

import json
import random
import time

import pytest

from trainmesh.app.cli import main
from trainmesh.plan import ranking

from fuzz import CaseTimeout, deadline

TINY = ["plan", "--model", "tiny", "--gpus", "8"]


def _run(argv: list[str]) -> int:
    """``main(argv)``'s exit status, argparse's ``SystemExit`` included."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def _one_line(capsys, argv: list[str]) -> str:
    assert _run(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("trainmesh: error: ") and captured.err.count("\n") == 1, captured.err
    assert not captured.out, "a refused plan printed a table"
    return captured.err


FLAG_CASES = [
    (["--gpus", "1000000000"], "argument --gpus: 1000000000: must be in [1, 1,048,576]"),
    (["--mem-gb", "inf"], "argument --mem-gb: inf: must be in (0, 1,048,576]"),
    (["--mem-gb", "1e308"], "argument --mem-gb: 1e308: must be in (0, 1,048,576]"),
    (["--mem-gb", "nan"], "argument --mem-gb: nan: must be in"),
    (["--peak-tflops", "nan"], "argument --peak-tflops: nan: must be in (0, 1,000,000]"),
    (["--peak-tflops", "-5"], "argument --peak-tflops: -5: must be in"),
    (["--intra-gbps", "0"], "argument --intra-gbps: 0: must be in (0, 1,000,000]"),
    (["--inter-gbps", "-1"], "argument --inter-gbps: -1: must be in"),
    (["--gpus-per-node", "0"], "argument --gpus-per-node: 0: must be in [1, 1,048,576]"),
    (["--vocab", "-1"], "argument --vocab: -1: must be in [1, 1,048,576]"),
    (["--experts", "0"], "argument --experts: 0: must be in [1, 4,096]"),
    (["--global-batch", "0"], "argument --global-batch: 0: must be in [1, 1,048,576]"),
    (["--top", "-3"], "argument --top: -3: must be in [1, 1,048,576]"),
    (["--slurm", "/dev/full"], "argument --slurm: /dev/full is not a regular file; name the script file to write"),
    (["--layers", "4097"], "argument --layers: 4097: must be in [1, 4,096]"),
]


@pytest.mark.parametrize("flags,message", FLAG_CASES, ids=[" ".join(f) for f, _ in FLAG_CASES])
def test_plan_numbers_out_of_range_are_one_line_naming_the_flag_and_range(capsys, no_search, flags, message):
    """Each was a traceback (OverflowError, AssertionError, ZeroDivisionError, "cannot convert float NaN to
    integer", "min() arg is an empty sequence"), a plan of nonsense, an endless search (``--gpus``) or a
    silent rewrite (``--global-batch 0`` planned as 8); each is now refused before the search."""
    assert message in _one_line(capsys, [*TINY, *flags])


@pytest.fixture
def no_search(monkeypatch):
    """The order of events, not a time: a refusal must come before the search enumerates any layout."""
    def enumerated(*_args):
        raise AssertionError("the search began before the refusal")
    monkeypatch.setattr(ranking, "enumerate_layouts", enumerated)


def test_slurm_into_a_directory_or_unwritable_place_is_refused_before_the_search(capsys, tmp_path):
    assert f"--slurm: {tmp_path} is not a regular file" in _one_line(capsys, [*TINY, "--slurm", str(tmp_path)])
    missing = tmp_path / "no" / "run.sbatch"
    assert f"--slurm: {missing} cannot be written" in _one_line(capsys, [*TINY, "--slurm", str(missing)])
    script = tmp_path / "run.sbatch"
    assert _run([*TINY, "--slurm", str(script)]) == 0 and script.read_text().startswith("#!")


def test_a_search_past_its_time_limit_stops_in_one_line(monkeypatch, capsys):
    """The bound on the search's time (``ranking.SEARCH_LIMIT_S``), at 0 s so that it trips at once."""
    monkeypatch.setattr(ranking.search, "__defaults__", (0.0,))
    err = _one_line(capsys, TINY)
    assert "the layout search over 8 devices passed its 0 s limit after" in err and "plan fewer devices" in err


def test_an_hf_config_of_more_layers_than_the_search_splits_is_one_line(tmp_path, capsys, no_search):
    """``num_hidden_layers`` 2**31 - 1 is a size ``--init-hf`` accepts (its weights would be missing), but
    its stage splits would never end: the search takes up to ``ranking.MAX_LAYERS``."""
    (tmp_path / "config.json").write_text(json.dumps({**HF_MOE, "num_hidden_layers": 2**31 - 1}))
    err = _one_line(capsys, ["plan", "--hf-config", str(tmp_path), "--gpus", "64"])
    assert "2,147,483,647 layers: the planner searches models of up to 4,096" in err


def test_the_largest_device_count_is_searched_in_seconds(capsys):
    """``--gpus 1,048,576`` (the bound) of a small model: a plan (a billion never finished). Exit 0 says the
    search ended inside its own limit (``ranking.SEARCH_LIMIT_S``), past which it refuses in one line."""
    assert _run(["plan", "--model", "tiny", "--gpus", str(ranking.MAX_GPUS)]) == 0
    assert "--nnodes" in capsys.readouterr().out


# --- the fuzzer ----------------------------------------------------------------------------------------------

HF_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256,
          "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
BASES = [
    "--model tiny --gpus 4",
    "--model moe-tiny --gpus 2 --global-batch 4 --gpu cpu",
    "--model deepseek-v3-tiny --gpus 2 --global-batch 2 --json",
    "--layers 2 --hidden 64 --heads 4 --vocab 256 --seq 64 --gpus 2 --gpu cpu --global-batch 4",
    "--layers 2 --hidden 64 --heads 4 --vocab 256 --seq 64 --mlp swiglu --experts 4 --top-k 2 --expert-ffn 32 "
    "--gpus 2 --global-batch 4",
    "--layers 2 --hidden 64 --heads 4 --vocab 256 --seq 64 --mlp swiglu --kv-lora-rank 16 --q-lora-rank 32 "
    "--qk-rope-dim 8 --qk-nope-dim 16 --v-head-dim 16 --gpus 2",
    "--hf-config {hf} --gpus 2 --global-batch 4",
]
NUMBER_FLAGS = ["--layers", "--hidden", "--heads", "--ffn", "--vocab", "--seq", "--kv-heads", "--head-dim",
                "--experts", "--top-k", "--expert-ffn", "--shared-experts", "--dense-layers", "--kv-lora-rank",
                "--q-lora-rank", "--qk-rope-dim", "--qk-nope-dim", "--v-head-dim", "--global-batch", "--gpus",
                "--gpus-per-node", "--mem-gb", "--peak-tflops", "--intra-gbps", "--inter-gbps", "--top"]
NUMBERS = ["0", "-1", "-5", "1", "2", "3", "4", "7", "8", "16", "2.5", "1e-300", "1e308", "inf", "-inf", "nan",
           "NaN", "", "x", "0x10", " 8", "1_000", "4096", "4097", "65536", "1048576", "1048577", "2147483648",
           "9" * 30]
CHOICE_FLAGS = {"--gpu": ["cpu", "h100-80gb", "bogus", ""], "--precision": ["fp16", "fp64", "bf16", "int8"],
                "--mlp": ["gelu", "swiglu", "relu"], "--reduce-dtype": ["bf16", "fp64", "x"],
                "--model": ["tiny", "llama3-8b", "mixtral-8x7b", "nope", ""]}


def _mutate(rng: random.Random, words: list[str], places: dict[str, str]) -> list[str]:
    """``words`` with one mutation: a number flag set (or added) to a hostile value, a choice flag to a
    good or bad choice, ``--slurm`` to a file, directory, device or missing place, a flag or value dropped,
    or a flag repeated."""
    words = list(words)
    how = rng.random()
    if how < 0.6:
        flag, value = rng.choice(NUMBER_FLAGS), rng.choice(NUMBERS)
    elif how < 0.75:
        flag = rng.choice(list(CHOICE_FLAGS))
        value = rng.choice(CHOICE_FLAGS[flag])
    elif how < 0.85:
        flag, value = "--slurm", rng.choice(list(places.values()))
    elif how < 0.95 and len(words) > 1:
        del words[rng.randrange(1, len(words))]
        return words
    else:
        flag, value = rng.choice([w for w in words if w.startswith("--")]), rng.choice(NUMBERS)
        return [*words, flag, value]
    if flag in words:
        words[words.index(flag) + 1: words.index(flag) + 2] = [value]
    else:
        words += [flag, value]
    return words


@pytest.mark.timeout(180)
def test_fuzzed_plan_command_lines_print_a_plan_or_one_line(tmp_path, capsys):
    """1,050 mutants of seven small plans (presets, explicit dense, MoE and latent-attention shapes, an HF
    config), one to three mutations each, through the CLI's ``main`` in this process, each under a 20 s
    deadline: a plan with exit 0, or exit 2 with one line on stderr."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(HF_MOE))
    places = {"file": str(tmp_path / "run.sbatch"), "dir": str(tmp_path), "device": "/dev/full",
              "null": "/dev/null", "missing": str(tmp_path / "no" / "run.sbatch"), "empty": ""}
    rng = random.Random(46)
    outcomes = {"planned": 0, "refused": 0}
    slowest = (0.0, "")
    start = time.monotonic()
    for case in range(1050):
        words = BASES[case % len(BASES)].format(hf=tmp_path / "hf").split()
        for _ in range(rng.randint(1, 3)):
            words = _mutate(rng, words, places)
        argv = ["plan", *words]
        label = f"case {case}: {' '.join(argv)}"
        began = time.monotonic()
        try:
            with deadline(20):
                code = _run(argv)
        except CaseTimeout:
            pytest.fail(f"{label} ran past 20 s")
        slowest = max(slowest, (time.monotonic() - began, label))
        out, err = capsys.readouterr()
        if code == 0:
            assert out and not err, f"{label}: {err}"
            outcomes["planned"] += 1
        else:
            assert code == 2 and err.startswith("trainmesh: error: ") and err.count("\n") == 1, f"{label}: {err}"
            outcomes["refused"] += 1
    elapsed = time.monotonic() - start
    with capsys.disabled():
        print(f"\nplan fuzzer: {outcomes} in {elapsed:.1f} s; slowest {slowest[0]:.1f} s ({slowest[1]})")
    assert outcomes["planned"] > 150 and outcomes["refused"] > 600, outcomes
