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
    (["--stage-layers", "1;1"], "--stage-layers 1;1: must be a comma-separated list of layer counts, e.g. 1,3"),
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
    ('[optim]\nsteps = "2"', 'steps = "2": must be a whole number'),
    ("[optim]\nglobal_batch = 4.0", "global_batch = 4.0: must be a whole number"),
    ("[layout]\ndp = 2.0", "dp = 2.0: must be a whole number"),
    ("[checkpoint]\ncheckpoint_dir = 5", "checkpoint_dir = 5: must be a string"),
    ('[checkpoint]\nresume = "no"', 'resume = "no": must be true or false'),
    ("[layout]\nzero = 5", "zero = 5: choose 0, 1, 2 or 3"),
    ('[layout]\nprecision = "fp4"', 'precision = "fp4": choose auto, fp32, bf16, fp16, fp64 or fp8'),
    ('[layout]\nstage_layers = "1;1"', 'stage_layers = "1;1": must be a comma-separated list of layer counts'),
    ("[optim]\nlr = inf", "lr = inf: must be a finite number"),
    ("[optim]\nmin_lr = nan", "min_lr = nan: must be a finite number"),
    ("[optim]\nbeta1 = 2", "beta1 = 2: must be in [0, 1)"),
    ("[optim]\nzero = 1", "zero is not a [optim] setting; move it to [layout]"),
    ("[optim]\nmicrobatches = 2", "microbatches is not a [optim] setting; move it to [layout]"),
    ("lr = 0.1", "lr is outside any table; move it to [optim]"),
    ("[optimizer]\nlr = 0.1", "unknown section [optimizer]; sections are [model], [moe], [data], [layout]"),
    ("[optim]\nlearnrate = 0.1", "unknown key [optim] learnrate"),
    ("[optim]\nglobal-batch = 8\nglobal_batch = 8", "global_batch is set twice"),
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
    toml.write_text('[model]\nseed = 3\n[launch]\nnproc = 2\ncollective_timeout = 30\n[layout]\ndp = 2\n'
                    'stage-layers = "1,3"\n[optim]\nglobal-batch = 8\nlr = 1\n'
                    '[checkpoint]\ncheckpoint-dir = "ck"\nresume = true\n')
    assert load_toml(str(toml)) == {"seed": 3, "nproc": 2, "dp": 2, "global_batch": 8, "lr": 1.0,
                                    "stage_layers": (1, 3), "checkpoint_dir": "ck", "resume": True,
                                    "collective_timeout": 30.0}
    cfg = config_from_args(cli._parser().parse_args(["train", "--config", str(toml), "--lr", "0.5"]))
    assert (cfg.optim.global_batch, cfg.optim.lr, cfg.checkpoint.resume) == (8, 0.5, True)
    assert isinstance(cfg.optim.lr, float) and cfg.layout.stage_layers == (1, 3)


def test_the_toml_tables_and_help_groups_are_the_config_sections(tmp_path):
    """Each section of :class:`Config` is one TOML table and one ``--help`` group holding exactly its fields'
    flags; every setting written in its own table reads back, and in any other table it is refused in one
    line naming the table it belongs in."""
    sections = {f.name: [g.name for g in fields(f.default_factory)] for f in fields(Config)}
    assert list(SECTIONS) == list(sections)
    train = next(a for a in cli._parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("train"))
    groups = {g.title: [a.dest for a in g._group_actions] for g in train._action_groups if g.title.startswith("[")}
    assert groups == {f"[{name}] settings": names for name, names in sections.items()}
    toml = tmp_path / "run.toml"
    for table, names in sections.items():
        toml.write_text(f"[{table}]\n" + "".join(f"{n} = {config._spell(config.FIELDS[n].default)}\n"
                                                 for n in names if n != "stage_layers"))
        assert load_toml(str(toml)).keys() == set(names) - {"stage_layers"}
        other = next(t for t in sections if t != table)
        toml.write_text(f"[{other}]\n{names[0]} = {config._spell(config.FIELDS[names[0]].default)}\n")
        with pytest.raises(ConfigError) as e:
            load_toml(str(toml))
        assert str(e.value) == f"{toml}: {names[0]} is not a [{other}] setting; move it to [{table}]"


def test_settings_round_trip_through_the_flat_names():
    cfg = Config.from_settings(dp=2, lr=0.1, stage_layers=(1, 3), out="o")
    assert Config.from_settings(**cfg.settings()) == cfg == cfg.replace(dp=2)
    assert (cfg.layout.dp, cfg.optim.lr, cfg.layout.stage_layers, cfg.logging.out) == (2, 0.1, (1, 3), "o")
    assert cfg.replace(tp=2).layout == dataclasses.replace(cfg.layout, tp=2)
    with pytest.raises(ConfigError, match="^unknown setting learnrate; settings are the flag names"):
        cfg.replace(learnrate=1)


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
            validate(Config().replace(**bad))


def test_check_value_names_any_file_source():
    with pytest.raises(ConfigError,
                       match=r"^ck/step-00000002/manifest.json: steps = -3: must be in \[1, 1,000,000,000\]$"):
        check_value("steps", -3, "ck/step-00000002/manifest.json")
    assert check_value("lr", 1, "run.toml") == 1.0


@pytest.mark.parametrize("body", ["[layout]\ndp = 2.0\n[launch]\nnproc = 2", '[optim]\nsteps = "2"', "[layout]\nzero = 5"])
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


NUMERIC = [f.name for f in config.FIELDS.values() if f.type in ("int", "float") and f.metadata["choices"] is None]


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
            assert from_flags(*argv).model.seed == 2**62
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
    cfg = Config.from_settings(eval_batches=config.EVAL_BATCHES_FLOOR)
    config.check_eval_batches(cfg, val_tokens=100, source="tiny.txt")  # a small split allows the floor
    big = cfg.replace(eval_batches=5_000)
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
