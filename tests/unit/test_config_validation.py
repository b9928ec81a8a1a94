"""One check for every configuration value, whatever its source: a flag, a TOML file or the Python API.
Pure logic, no processes."""

import dataclasses
from dataclasses import fields

import pytest

from trainmesh.app import cli, config
from trainmesh import launcher
from trainmesh.app.config import SECTIONS, Config, ConfigError, check_value, config_from_args, load_toml, validate


def from_flags(*argv: str) -> Config:
    cfg = config_from_args(cli._parser().parse_args(["train", *argv]))
    validate(cfg)
    return cfg


BAD_FLAGS = [
    (["--lr", "inf"], "--lr inf: must be a finite number"),
    (["--min-lr", "nan"], "--min-lr nan: must be a finite number"),
    (["--seed", "1e20"], "--seed 1e20: must be a whole number"),
    (["--seed", "-1"], "--seed -1: must be at least 0"),
    (["--seed", str(2**63)], f"--seed {2**63}: must be less than 2**63"),
    (["--beta1", "2"], "--beta1 2: must be in [0, 1)"),
    (["--beta2", "1"], "--beta2 1: must be in [0, 1)"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must be at least 0"),
    (["--grad-clip", "inf"], "--grad-clip inf: must be a finite number"),
    (["--bucket-mb", "0"], "--bucket-mb 0: must be greater than 0"),
    (["--collective-timeout", "0"], "--collective-timeout 0: must be greater than 0"),
    (["--zero", "5"], "--zero 5: choose 0, 1, 2 or 3"),
    (["--precision", "fp8"], "--precision fp8: choose auto, fp32, bf16, fp16 or fp64"),
    (["--dp", "2.0"], "--dp 2.0: must be a whole number"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--lr", "0"], "--lr 0: must be greater than 0"),
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
    ('precision = "fp8"', 'precision = "fp8": choose auto, fp32, bf16, fp16 or fp64'),
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
    with pytest.raises(ConfigError, match="is a directory; give --config a TOML file"):
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
    with pytest.raises(ConfigError, match=r"^ck/step-00000002/manifest.json: steps = -3: must be at least 1$"):
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
