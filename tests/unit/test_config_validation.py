"""One check for every configuration value, whatever its source: a flag, a TOML file or the Python API.
Pure logic, no processes."""

import dataclasses
import os
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from trainmesh.app import cli, config
from trainmesh.distributed import launcher
from trainmesh.app.config import SECTIONS, Config, ConfigError, check_value, config_from_args, load_toml, validate


def from_flags(*argv: str) -> Config:
    cfg = config_from_args(cli._parser().parse_args(["train", *argv]))
    validate(cfg)
    return cfg


BAD_FLAGS = [
    (["--lr", "inf"], "--lr inf: must be a finite number"),
    (["--min-lr", "nan"], "--min-lr nan: must be a finite number"),
    (["--seed", "1e20"], "--seed 1e20: must be a whole number"),
    (["--seed", "-1"], "--seed -1: must be in [0, 9,223,372,036,854,775,807]"),
    (["--seed", str(2**63)], f"--seed {2**63}: must be less than 2**63"),
    (["--beta1", "2"], "--beta1 2: must be in [0, 1)"),
    (["--beta2", "1"], "--beta2 1: must be in [0, 1)"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be in [0, 100]"),
    (["--grad-clip", "inf"], "--grad-clip inf: must be a finite number"),
    (["--bucket-mb", "0"], "--bucket-mb 0: must be in (0, 1,048,576]"),
    (["--collective-timeout", "0"], "--collective-timeout 0: must be in [1, 604,800]"),
    (["--zero", "5"], "--zero 5: choose 0, 1, 2 or 3"),
    (["--precision", "fp4"], "--precision fp4: choose auto, fp32, bf16, fp16, fp64 or fp8"),
    (["--dp", "2.0"], "--dp 2.0: must be a whole number"),
    (["--steps", "0"], "--steps 0: must be in [1, 1,000,000,000]"),
    (["--lr", "0"], "--lr 0: must be in (0, 10]"),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 exceeds --lr 0.01"),
]


@pytest.mark.parametrize("argv,message", BAD_FLAGS, ids=[m for _, m in BAD_FLAGS])
def test_bad_flag_value_is_one_line_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        from_flags(*argv)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


BAD_TOML = [
    ('steps = "2"', 'steps = "2": must be a whole number'),
    ("global_batch = 4.0", "global_batch = 4.0: must be a whole number"),
    ("dp = 2.0", "dp = 2.0: must be a whole number"),
    ("checkpoint_dir = 5", "checkpoint_dir = 5: must be a string"),
    ('resume = "no"', 'resume = "no": must be true or false'),
    ("zero = 5", "zero = 5: choose 0, 1, 2 or 3"),
    ('precision = "fp4"', 'precision = "fp4": choose auto, fp32, bf16, fp16, fp64 or fp8'),
    ("lr = inf", "lr = inf: must be a finite number"),
    ("min_lr = nan", "min_lr = nan: must be a finite number"),
    ("beta1 = 2", "beta1 = 2: must be in [0, 1)"),
    ("[optim]\nzero = 1", "zero is not a [optim] setting; move it to [layout]"),
    ("[optimizer]\nlr = 0.1", "unknown section [optimizer]; sections are [model], [layout]"),
    ("[optim]\nlearnrate = 0.1", "unknown key [optim] learnrate"),
    ("global-batch = 8\nglobal_batch = 8", "global_batch is set twice"),
]


@pytest.mark.parametrize("body,message", BAD_TOML, ids=[m for _, m in BAD_TOML])
def test_bad_toml_value_is_one_line_naming_the_file(tmp_path, body, message):
    toml = tmp_path / "run.toml"
    toml.write_text(body + "\n")
    with pytest.raises(ConfigError) as e:
        load_toml(str(toml))
    assert str(e.value).startswith(f"{toml}: {message}")
    assert "\n" not in str(e.value)


def test_flag_and_toml_say_the_same_about_the_same_mistake(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[layout]\nzero = 5\n")
    with pytest.raises(ConfigError, match=r"^.*run\.toml: zero = 5: choose 0, 1, 2 or 3$"):
        load_toml(str(toml))
    with pytest.raises(ConfigError, match=r"^--zero 5: choose 0, 1, 2 or 3$"):
        from_flags("--zero", "5")


def test_toml_takes_flag_spelling_and_sections(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('seed = 3\n[layout]\nnproc = 2\ndp = 2\n[optim]\nglobal-batch = 8\nlr = 1\n'
                    '[checkpoint]\ncheckpoint-dir = "ck"\nresume = true\n[runtime]\ncollective_timeout = 30\n')
    assert load_toml(str(toml)) == {"seed": 3, "nproc": 2, "dp": 2, "global_batch": 8, "lr": 1.0,
                                    "checkpoint_dir": "ck", "resume": True, "collective_timeout": 30.0}
    cfg = from_flags("--config", str(toml), "--lr", "0.5")
    assert (cfg.global_batch, cfg.lr, cfg.resume) == (8, 0.5, True) and isinstance(cfg.lr, float)


def test_every_field_is_in_exactly_one_section():
    names = [name for section in SECTIONS.values() for name in section]
    assert sorted(names) == sorted(f.name for f in fields(Config))


def test_config_file_that_is_a_directory_or_binary_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a regular file; give --config a TOML file"):
        load_toml(str(tmp_path))
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x80\x04\x95 pickle \xff\x00")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(invalid byte 0x80 at offset 0\)"):
        load_toml(str(binary))


def test_validate_checks_values_given_through_the_python_api():
    validate(Config())
    for bad, message in ((dict(lr=float("nan")), "--lr nan: must be a finite number"),
                         (dict(dp="2"), "--dp 2: must be a whole number"),
                         (dict(resume=1), "--resume 1: must be true or false")):
        with pytest.raises(ConfigError, match=f"^{message}"):
            validate(dataclasses.replace(Config(), **bad))


def test_check_value_names_any_file_source():
    with pytest.raises(ConfigError,
                       match=r"^ck/step-00000002/manifest.json: steps = -3: must be in \[1, 1,000,000,000\]$"):
        check_value("steps", -3, "ck/step-00000002/manifest.json")
    assert check_value("lr", 1, "run.toml") == 1.0


@pytest.mark.parametrize("body", ["dp = 2.0\nnproc = 2", 'steps = "2"', "zero = 5"])
def test_bad_toml_spawns_nothing(tmp_path, monkeypatch, capsys, body):
    def no_spawn(*_a, **_k):
        raise AssertionError("a rank was spawned for an invalid config")

    monkeypatch.setattr(launcher, "launch", no_spawn)
    toml = tmp_path / "run.toml"
    toml.write_text(body + "\n")
    assert cli.main(["train", "--config", str(toml), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trainmesh: error: {toml}: ") and err.count("\n") == 1


def test_world_size_from_the_environment_is_checked_too(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2.5")
    args = cli._parser().parse_args(["train"])
    with pytest.raises(ConfigError, match=r"^environment WORLD_SIZE: nproc = 2.5: must be a whole number$"):
        cli.checked_config(args)


def test_every_setting_belongs_to_one_toml_section():
    names = [name for section in SECTIONS.values() for name in section]
    assert sorted(names) == sorted(f.name for f in fields(Config)) == sorted(config.SECTION_OF)


NUMERIC = [f.name for f in fields(Config) if f.type in ("int", "float") and f.metadata["choices"] is None]


def _outside_values(name: str) -> list:
    """Values just beyond each end of field ``name``'s range, as the user would type them."""
    low, high = config.FIELDS[name].metadata["low"], config.FIELDS[name].metadata["high"]
    whole = config.FIELDS[name].type == "int"
    step = 1 if whole else max(abs(high.value) * 1e-6, 1e-9)
    return [low.value if low.strict else low.value - step, high.value if high.strict else high.value + step]


@pytest.mark.parametrize("name", NUMERIC)
def test_every_number_has_a_range_and_what_lies_outside_it_is_one_line(name):
    """Every number a user can type has both ends of its range in the flag table, and a value just
    outside either end, typed as a flag, is refused in one line naming the flag and the range, before
    any rank could start; the ends themselves (when not strict) are accepted."""
    meta = config.FIELDS[name].metadata
    assert meta["low"] is not None and meta["high"] is not None, f"{name} has no range"
    flag = "--" + name.replace("_", "-")
    for value in _outside_values(name):
        text = str(int(value)) if config.FIELDS[name].type == "int" else repr(float(value))
        with pytest.raises(ConfigError) as e:
            config_from_args(cli._parser().parse_args(["train", f"{flag}={text}"]))
        assert str(e.value).startswith(f"{flag} {text}: must be ") and "\n" not in str(e.value), str(e.value)
    for end in (meta["low"], meta["high"]):
        if not end.strict:
            assert check_value(name, int(end.value) if config.FIELDS[name].type == "int" else end.value) == end.value


def test_the_hostile_numbers_of_the_second_round_are_one_line():
    for argv, message in ((["--seed", "4611686018427387904"], None),
                          (["--collective-timeout", "1e300"], "--collective-timeout 1e300: must be in [1, 604,800]"),
                          (["--collective-timeout", "1e-9"], "--collective-timeout 1e-9: must be in [1, 604,800]"),
                          (["--microbatches", "1000000000000"], "--microbatches 1000000000000: must be in [1, "),
                          (["--eval-batches", "1000000000000"], "--eval-batches 1000000000000: must be in [1, "),
                          (["--steps", "1000000000000"], "--steps 1000000000000: must be in [1, 1,000,000,000]")):
        if message is None:
            assert from_flags(*argv).seed == 2**62
            continue
        with pytest.raises(ConfigError) as e:
            from_flags(*argv)
        assert str(e.value).startswith(message), str(e.value)


def test_a_seed_up_to_2_63_draws_batches_and_small_seeds_draw_what_they_always_did():
    from trainmesh.data import global_batch_offsets

    assert global_batch_offsets(1000, 8, 4, 2**63 - 1, 10**9 + 5).shape == (4,)
    old = torch.randint(0, 1000 - 8, (4,), generator=torch.Generator().manual_seed(7 * 1_000_003 + 3))
    assert torch.equal(global_batch_offsets(1000, 8, 4, 7, 3), old)


def test_eval_batches_are_bounded_by_the_validation_split():
    cfg = Config(eval_batches=config.EVAL_BATCHES_FLOOR)
    config.check_eval_batches(cfg, val_tokens=100, source="tiny.txt")  # a small split allows the floor
    big = dataclasses.replace(cfg, eval_batches=5_000)
    config.check_eval_batches(big, val_tokens=5_000 * 16 * 32, source="big")
    with pytest.raises(ConfigError, match=r"^--eval-batches 5000: the validation split of big holds 819,200 tokens, "
                                          r"which 1,600 batch\(es\) of 16 x 32 tokens cover; choose --eval-batches "
                                          r"at most 1,600$"):
        config.check_eval_batches(big, val_tokens=1_600 * 16 * 32, source="big")


@pytest.mark.parametrize("kind", ["fifo", "device", "too large", "nested", "link to fifo"])
def test_a_config_that_is_no_regular_file_or_nests_deeply_is_one_line_at_once(tmp_path, kind):
    path = tmp_path / "run.toml"
    if kind in ("fifo", "link to fifo"):
        os.mkfifo(tmp_path / "fifo")
        path = tmp_path / "fifo" if kind == "fifo" else path
        if kind == "link to fifo":
            path.symlink_to(tmp_path / "fifo")
        expect = "is a FIFO, not a regular file"
    elif kind == "device":
        path, expect = Path("/dev/zero"), "is a device or socket, not a regular file"
    elif kind == "too large":
        path.write_bytes(b"# " + b"x" * config.TOML_LIMIT + b"\n")
        expect = f"is larger than {config.TOML_LIMIT:,} bytes"
    else:
        path.write_text("a = " + "[" * 50_000 + "]" * 50_000 + "\n")
        expect = "nests arrays or tables too deeply to parse"
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_toml(str(path))
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert time.monotonic() - start < 5


OTHER_COMMANDS = [
    (["schedule", "--pp", "65"], "argument --pp: 65: must be in [1, 64]"),
    (["schedule", "--microbatches", "0"], "argument --microbatches: 0: must be in [1, 256]"),
    (["schedule", "--virtual-stages", "1e3"], "argument --virtual-stages: 1e3: must be a whole number"),
    (["generate", "--checkpoint-dir", "c", "--prompt", "p", "--seed", str(2**63)],
     f"argument --seed: {2**63}: must be in [0, 9,223,372,036,854,775,807]"),
    (["generate", "--checkpoint-dir", "c", "--prompt", "p", "--max-new-tokens", "1048577"],
     "argument --max-new-tokens: 1048577: must be in [1, 1,048,576]"),
    (["generate", "--checkpoint-dir", "c", "--prompt", "p", "--top-p", "1.5"],
     "argument --top-p: 1.5: must be in (0, 1]"),
    (["generate", "--checkpoint-dir", "c", "--prompt", "p", "--temperature", "inf"],
     "argument --temperature: inf: must be in [0, 1,000]"),
    (["generate", "--checkpoint-dir", "c", "--prompt", "p", "--step=-1"], "argument --step: -1: must be in [0, "),
    (["bench", "dp", "--pairs", "0"], "argument --pairs: 0: must be in [1, 10,000]"),
    (["tokenizer", "train", "--out", "t.json", "--vocab-size", "1048577"],
     "argument --vocab-size: 1048577: must be in [1, 1,048,576]"),
]


@pytest.mark.parametrize("argv,message", OTHER_COMMANDS, ids=[" ".join(a[:2]) + " " + a[-1] for a, _ in OTHER_COMMANDS])
def test_the_numbers_of_the_other_commands_have_ranges_too(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli._parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_schedule_too_large_a_prompt_not_utf8_and_a_launch_grace_out_of_range_are_one_line(capsys):
    assert cli.main(["schedule", "--pp", "64", "--microbatches", "64"]) == 2
    assert "is more than the 2,048 stage-micro-batches schedule simulates" in capsys.readouterr().err
    prompt = b"\xff".decode("utf-8", "surrogateescape")  # what Python makes of generate --prompt $'\xff'
    assert cli.main(["generate", "--checkpoint-dir", "none", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert "--prompt holds byte 0xff at character 0, which is not UTF-8 text" in err and err.count("\n") == 1
    assert cli.main(["launch", "--stopped-grace", "0", "script.py"]) == 2
    assert "--stopped-grace 0: must be in [1, 604,800]" in capsys.readouterr().err
