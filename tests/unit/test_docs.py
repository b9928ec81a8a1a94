"""README.md and docs/*.md say only what is true of this checkout.

For every markdown file, failures named by file and line:

* each fenced ``python`` (and ``toml``) block parses, and uses the real API: every ``trainmesh`` name it
  imports or reaches exists, each call of one fits its signature, and each stub ``def name(...): ...`` of a
  public name has the real parameters and defaults;
* each ``trainmesh <subcommand>`` in a fenced bash/sh/shell/console block names a subcommand that exists,
  every ``--flag`` it uses appears in that subcommand's ``--help``, the command line parses with the CLI's own
  parser and, for ``train`` and ``bench``, each value passes the check a run applies to it (``--zero 5``);
  each ``make TARGET`` is a Makefile target, each ``-m trainmesh.x`` module and each script path
  (``examples/x.py``, ``scripts/x.sh``) exists;
* each relative link ``[x](path#anchor)`` resolves to a file, and the anchor to a heading of a markdown target.

Nothing is spawned: the parser is built in-process (``trainmesh.app.cli._parser``) and its ``--help`` rendered once
per subcommand; without ``_parser`` the checks fall back to one ``python -m trainmesh SUB --help`` per
subcommand. ``...`` in a command stands for "more flags" and is skipped.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import re
import shlex
import subprocess
import sys
import textwrap
import urllib.parse
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELLS = {"bash", "sh", "shell", "console", "zsh"}
PYTHONS = {"python", "py", "python3"}
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", ";;", "|&"}
REDIRECTS = {">", ">>", "<", "<<", ">&", "<&", "&>"}


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the block's first content line
    lines: list[str]


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown text (``` or ~~~ fences, any indentation)."""
    blocks, current, fence = [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if current is None:
            m = re.match(r"(`{3,}|~{3,})\s*([\w+.-]*)", stripped)
            if m:
                fence, current = m.group(1), Block(m.group(2).lower(), number + 1, [])
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            blocks.append(current)
            current = None
        else:
            current.lines.append(line)
    if current is not None:
        blocks.append(current)  # unclosed: still checked
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks, inline code spans blanked out."""
    out, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not fence:
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                fence = m.group(1)
                continue
            out.append((number, re.sub(r"(`+)(.+?)\1", "", line)))
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            fence = ""
    return out


# ---- python blocks ------------------------------------------------------------------------------------------

def python_problems(path: Path, text: str) -> list[str]:
    problems = []
    for block in fenced_blocks(text):
        if block.lang not in PYTHONS:
            continue
        try:
            ast.parse(textwrap.dedent("\n".join(block.lines)))
        except SyntaxError as e:
            problems.append(f"{where(path, block.line + (e.lineno or 1) - 1)}: python block does not parse: {e.msg}")
    return problems


MISSING = object()


def resolve(dotted: str):
    """The object a dotted trainmesh name stands for (submodules imported as needed), or MISSING."""
    parts = dotted.split(".")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        return MISSING
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i + 1]))
        except ImportError:
            return MISSING
    return obj


def chain_of(expr: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    names = []
    while isinstance(expr, ast.Attribute):
        names.append(expr.attr)
        expr = expr.value
    return [expr.id, *reversed(names)] if isinstance(expr, ast.Name) else None


def signature_problem(doc: ast.FunctionDef, real) -> str | None:
    """A documented stub ``def f(...) -> T: ...`` against the real ``f``: its parameters must be real ones, in
    order, with the real defaults (optional ones may be left out; required ones may not)."""
    try:
        params = list(inspect.signature(real).parameters.values())
    except (TypeError, ValueError):
        return None
    args = doc.args
    positional = args.posonlyargs + args.args
    documented = [(a.arg, d) for a, d in zip(positional, [None] * (len(positional) - len(args.defaults))
                                              + list(args.defaults))]
    documented += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    names = [p.name for p in params]
    at = -1
    for name, default in documented:
        if name not in names:
            return f"parameter {name} is not one of {doc.name}'s ({', '.join(names)})"
        index = names.index(name)
        if index < at:
            return f"parameter {name} is out of order (the real order: {', '.join(names)})"
        at = index
        real_default = params[index].default
        if default is None and real_default is not inspect.Parameter.empty:
            continue
        try:
            value = ast.literal_eval(default) if default is not None else inspect.Parameter.empty
        except ValueError:
            continue
        if value != real_default:
            real = "no default" if real_default is inspect.Parameter.empty else f"the default {real_default!r}"
            return f"parameter {name}: documented with the default {ast.unparse(default)}, but it has {real}"
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    left_out = [n for n in required if n not in dict(documented)]
    return f"required parameter(s) {', '.join(left_out)} left out" if left_out else None


def api_problems(path: Path, text: str) -> list[str]:
    """Python blocks use the real API: every ``trainmesh`` name imported or reached by attribute exists, each
    call of one binds to its signature (no unknown keyword, no missing argument), and each stub
    ``def name(...): ...`` of a public name has the real parameters and defaults."""
    problems = []
    for block in fenced_blocks(text):
        if block.lang not in PYTHONS:
            continue
        try:
            tree = ast.parse(textwrap.dedent("\n".join(block.lines)))
        except SyntaxError:
            continue  # python_problems reports it
        found: dict[int, list[str]] = {}

        def problem(node: ast.AST, what: str) -> None:
            line = block.line + node.lineno - 1
            if what not in found.setdefault(line, []):
                found[line].append(what)
                problems.append(f"{where(path, line)}: {what}")

        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "trainmesh":
                        if resolve(a.name) is MISSING:
                            problem(node, f"import {a.name}: no such module")
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "trainmesh"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "trainmesh":
                for a in node.names:
                    if resolve(f"{node.module}.{a.name}") is MISSING:
                        problem(node, f"from {node.module} import {a.name}: no such name")
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"

        def target(expr: ast.expr) -> tuple[str, object] | None:
            chain = chain_of(expr)
            if not chain or chain[0] not in aliases:
                return None
            dotted = ".".join([aliases[chain[0]], *chain[1:]])
            return dotted, resolve(dotted)

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                hit = target(node)
                if hit and hit[1] is MISSING and (parent := target(node.value)) and parent[1] is not MISSING:
                    problem(node, f"{hit[0]} does not exist")
            elif isinstance(node, ast.Call):
                hit = target(node.func)
                if not hit or hit[1] is MISSING or not callable(hit[1]):
                    continue
                if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                    continue
                try:
                    inspect.signature(hit[1]).bind(*node.args, **{k.arg: k.value for k in node.keywords})
                except TypeError as e:
                    problem(node, f"{hit[0]}(...) does not fit its signature: {e}")
                except ValueError:
                    pass
        for node in tree.body:
            if (isinstance(node, ast.FunctionDef) and len(node.body) == 1 and isinstance(node.body[0], ast.Expr)
                    and isinstance(node.body[0].value, ast.Constant) and node.body[0].value.value is Ellipsis):
                real = resolve(f"trainmesh.{node.name}")
                if real is not MISSING and callable(real):
                    complaint = signature_problem(node, real)
                    if complaint:
                        problem(node, f"def {node.name}: {complaint}")
    return problems


def toml_problems(path: Path, text: str) -> list[str]:
    """Each fenced ``toml`` block parses (a config example a reader copies into run.toml)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    problems = []
    for block in fenced_blocks(text):
        if block.lang == "toml":
            try:
                tomllib.loads("\n".join(block.lines))
            except tomllib.TOMLDecodeError as e:
                problems.append(f"{where(path, block.line)}: toml block does not parse: {e}")
    return problems


# ---- shell blocks -------------------------------------------------------------------------------------------

def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(line number, logical command line) of a shell block: backslash continuations joined, a console
    block's prompt lines only (``$ ``), its output left out."""
    commands, pending, start = [], "", 0
    for offset, raw in enumerate(block.lines):
        line = raw.rstrip()
        if block.lang == "console" and not pending:
            if not line.lstrip().startswith("$ "):
                continue
            line = line.lstrip()[2:]
        if not pending:
            start = block.line + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        commands.append((start, pending + line))
        pending = ""
    if pending:
        commands.append((start, pending))
    return commands


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of a shell line (split at pipes, ``&&``, ``;``; comments and
    redirection targets left out)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"cannot split {line.strip()!r}: {e}") from None
    commands, words, skip = [], [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in OPERATORS:
            commands.append(words)
            words = []
        elif token in REDIRECTS or (token and set(token) <= set("<>&")):
            if words and words[-1].isdigit():
                words.pop()  # the 2 of 2>
            skip = True
        else:
            words.append(token)
    commands.append(words)
    return [c for c in commands if c]


@lru_cache(maxsize=None)
def cli_parser() -> argparse.ArgumentParser | None:
    """``trainmesh``'s own parser, built in-process, or None if the CLI no longer offers ``_parser``."""
    from trainmesh.app import cli

    return cli._parser() if hasattr(cli, "_parser") else None


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


@lru_cache(maxsize=None)
def help_text(words: tuple[str, ...]) -> str | None:
    """``trainmesh WORDS --help``'s text, or None if WORDS name no subcommand. In-process when the parser is
    available, else one ``python -m trainmesh WORDS --help`` per distinct subcommand."""
    parser = cli_parser()
    if parser is None:
        run = subprocess.run([sys.executable, "-m", "trainmesh", *words, "--help"], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        return run.stdout if run.returncode == 0 else None
    for word in words:
        parser = subparsers(parser).get(word)
        if parser is None:
            return None
    return parser.format_help()


def usage_of(text: str | None) -> str:
    """The usage lines of a ``--help`` text."""
    return (text or "").split("\n\n", 1)[0]


def subcommand_of(args: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the subcommand words, the rest): ``tokenizer train`` is two words."""
    parser, words = cli_parser(), []
    while args and not args[0].startswith("-"):
        if parser is None and words:  # no parser: a nested subcommand is one its usage lists as {a,b}
            choices = re.findall(r"\{([\w,-]+)\}", usage_of(help_text(tuple(words))))
            if not any(args[0] in c.split(",") for c in choices):
                break
        words.append(args[0])
        args = args[1:]
        if parser is not None:
            parser = subparsers(parser).get(words[-1])
            if parser is None or not subparsers(parser):
                break
    return tuple(words), args


def own_args(words: tuple[str, ...], args: list[str]) -> list[str]:
    """Without the parser: the args before a positional whose usage ends in ``...`` (``launch``'s script)."""
    usage = usage_of(help_text(words))
    if not re.search(r"\.\.\.\]?\s*$", usage):
        return args
    i = 0
    while i < len(args):
        if not args[i].startswith("-"):
            return args[:i]
        takes_value = "=" not in args[i] and re.search(re.escape(args[i]) + r" [A-Z{]", usage)
        i += 2 if takes_value else 1
    return args


def remainder_of(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> list[str]:
    """What an ``argparse.REMAINDER`` positional swallowed (``launch``'s script arguments: not ours to check)."""
    for action in parser._actions:
        if action.nargs == argparse.REMAINDER:
            return list(getattr(namespace, action.dest, None) or [])
    return []


def parse_problem(words: tuple[str, ...], args: list[str]) -> tuple[str | None, list[str]]:
    """(argparse's complaint about ``trainmesh WORDS ARGS`` or None, the args that are trainmesh's own)."""
    parser = cli_parser()
    if parser is None:
        return None, own_args(words, args)
    sub = parser
    for word in words:
        sub = subparsers(sub)[word]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            namespace = parser.parse_args([*words, *args])
    except SystemExit:
        message = err.getvalue().strip().splitlines()
        return (message[-1] if message else "the parser refused it"), args
    rest = remainder_of(sub, namespace)
    own = args[:len(args) - len(rest)] if rest else args
    return value_problem(words, namespace), own


def value_problem(words: tuple[str, ...], namespace: argparse.Namespace) -> str | None:
    """For ``train``/``bench``: the check every run applies to each flag's value (``--zero 5``)."""
    if words[:1] not in (("train",), ("bench",)):
        return None
    try:
        from trainmesh.app.config import FIELDS, ConfigError, check_value, parse_flag
    except ImportError:
        return None
    for name in FIELDS:
        value = getattr(namespace, name, None)
        if value is None or (isinstance(value, str) and value.startswith("$")):
            continue
        try:
            if isinstance(value, bool):
                check_value(name, value)
            else:
                check_value(name, parse_flag(name, value), written=value)
        except ConfigError as e:
            return str(e)
    return None


@lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def trainmesh_at(words: list[str]) -> int | None:
    """Where ``trainmesh`` (any path to it, or ``-m trainmesh``) is in a simple command's words."""
    for i, word in enumerate(words):
        if "install" in words[:i]:
            return None  # pip install trainmesh
        if Path(word).name == "trainmesh" or (word == "trainmesh" and i and words[i - 1] == "-m"):
            return i
    return None


def command_problems(words: list[str]) -> list[str]:
    """What is wrong with one simple command of a shell block."""
    problems = []
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("trainmesh."):
            module = words[i + 1]
            if importlib.util.find_spec(module) is None:
                problems.append(f"module {module} does not exist")
        if (re.fullmatch(r"[\w.-]+(/[\w.-]+)+\.(py|sh)", word) and not word.startswith(("/", "$"))
                and not (ROOT / word).exists()):
            problems.append(f"{word} does not exist")
    if Path(words[0]).name == "make":
        for target in words[1:]:
            if not target.startswith("-") and "=" not in target and target not in make_targets():
                problems.append(f"make {target}: no such target in the Makefile")
    at = trainmesh_at(words)
    if at is None:
        return problems
    args = [w for w in words[at + 1:] if w != "..."]
    sub, rest = subcommand_of(args)
    if not sub and rest and rest[0] not in ("-h", "--help"):
        return problems + [f"trainmesh {rest[0]}: the command needs a subcommand first"]
    if sub and help_text(sub) is None:
        return problems + [f"trainmesh {' '.join(sub)}: no such subcommand (see trainmesh --help)"]
    complaint, own = (None, rest) if {"-h", "--help"} & set(rest) else parse_problem(sub, rest)
    text = help_text(sub)
    helped = set(re.findall(r"--[A-Za-z0-9][\w-]*", text or ""))
    named = f"trainmesh {' '.join(sub)}".rstrip()
    for arg in own:
        flag = arg.split("=", 1)[0]
        if re.fullmatch(r"--[A-Za-z0-9][\w-]*", flag) and flag not in helped:
            problems.append(f"{named}: {flag} is not in '{named} --help'")
    if complaint and not problems:
        problems.append(f"{named}: {complaint}")
    return problems


def shell_problems(path: Path, text: str) -> list[str]:
    problems = []
    for block in fenced_blocks(text):
        if block.lang not in SHELLS:
            continue
        for line, command in shell_commands(block):
            try:
                commands = simple_commands(command)
            except ValueError as e:
                problems.append(f"{where(path, line)}: {e}")
                continue
            for words in commands:
                problems += [f"{where(path, line)}: {p}\n    {command.strip()}" for p in command_problems(words)]
    return problems


# ---- links --------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+[\"'][^\"']*[\"'])?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as rendered, lower case, punctuation but ``-`` and ``_``
    dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines_raw(path):
        m = re.match(r"\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    for _, line in prose_lines_raw(path):  # explicit <a name="x"> / id="x" anchors
        out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return frozenset(out)


def prose_lines_raw(path: Path) -> list[tuple[int, str]]:
    """Lines outside fenced blocks, inline code kept (a heading's code is part of its anchor)."""
    out, fence = [], ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if not fence:
            m = re.match(r"(`{3,}|~{3,})", stripped)
            if m:
                fence = m.group(1)
            else:
                out.append((number, line))
        elif stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            fence = ""
    return out


def link_problems(path: Path, text: str) -> list[str]:
    problems = []
    for number, line in prose_lines(text):
        targets = [m.group(1) for m in LINK.finditer(line)]
        m = REFERENCE.match(line)
        if m:
            targets.append(m.group(1))
        for target in targets:
            if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # http:, https:, mailto:, ...
            file_part, _, anchor = target.partition("#")
            file = (path.parent / urllib.parse.unquote(file_part)).resolve() if file_part else path
            if not file.exists():
                problems.append(f"{where(path, number)}: link [{target}] -> {file_part}: no such file "
                                f"(relative to {rel(path.parent) or '.'}/)")
            elif anchor and file.suffix == ".md" and file.is_file() and anchor.lower() not in anchors(file):
                problems.append(f"{where(path, number)}: link [{target}]: {rel(file)} has no heading "
                                f"#{anchor}")
    return problems


# ---- the tests ----------------------------------------------------------------------------------------------

def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def where(path: Path, line: int) -> str:
    return f"{rel(path)}:{line}"


def report(problems: list[str]) -> None:
    if problems:
        pytest.fail(f"{len(problems)} problem(s):\n" + "\n".join(problems), pytrace=False)


IDS = [rel(p) for p in MARKDOWN]


@pytest.mark.parametrize("path", MARKDOWN, ids=IDS)
def test_python_blocks_parse(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    report(python_problems(path, text) + toml_problems(path, text))


@pytest.mark.parametrize("path", MARKDOWN, ids=IDS)
def test_python_blocks_use_the_real_api(path: Path) -> None:
    report(api_problems(path, path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("path", MARKDOWN, ids=IDS)
def test_shell_commands_are_real(path: Path) -> None:
    report(shell_problems(path, path.read_text(encoding="utf-8")))


@pytest.mark.parametrize("path", MARKDOWN, ids=IDS)
def test_relative_links_resolve(path: Path) -> None:
    report(link_problems(path, path.read_text(encoding="utf-8")))


def test_readme_links_every_guide() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / m.group(1).partition("#")[0]).resolve()
              for _, line in prose_lines(readme) for m in LINK.finditer(line)}
    missing = [rel(p) for p in MARKDOWN[1:] if p.resolve() not in linked]
    assert not missing, f"README.md links no guide {missing}; add them to its list of guides"


def test_readme_shows_the_ci_test_command() -> None:
    """CI runs .ci/run, which runs `make test`; the README shows that exact command in a shell block."""
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    shown = [c for b in fenced_blocks((ROOT / "README.md").read_text(encoding="utf-8")) if b.lang in SHELLS
             for _, line in shell_commands(b) for c in simple_commands(line)]
    assert ["make", "test"] in shown, "README.md shows no `make test` (the command CI runs) in a shell block"


def test_the_checks_catch_planted_mistakes(tmp_path: Path) -> None:
    """Each check fails on a planted mistake, naming the file and line."""
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent("""\
        # Title
        [ok](there.md#a-heading) [gone](nowhere.md) [bad anchor](there.md#nope) `[code](skipped.md)`

        ```python
        def broken(:
        ```

        ```python
        import trainmesh as tm
        mesh = tm.init_mesh(tpp=2)
        tm.no_such_function()
        def load(model, directory) -> int: ...
        ```

        ```bash
        trainmesh train --nproc 2 --no-such-flag 3
        trainmesh nosuchcommand --x 1
        trainmesh train --zero 5
        trainmesh launch --nproc 2 examples/train_custom_module.py --tp 2
        make no-such-target
        ```
        """))
    text = page.read_text()
    links = link_problems(page, text)
    assert len(links) == 2, links
    assert "page.md:2" in links[0] and "nowhere.md" in links[0] and "#nope" in links[1]
    python = python_problems(page, text)
    assert len(python) == 1 and "page.md:5" in python[0], python
    api = api_problems(page, text)
    assert len(api) == 3, api
    assert "page.md:10" in api[0] and "tpp" in api[0]
    assert "page.md:11" in api[1] and "trainmesh.no_such_function does not exist" in api[1]
    assert "page.md:12" in api[2] and "opt left out" in api[2]
    shell = shell_problems(page, text)
    assert len(shell) == 4, shell  # launch's --tp is the script's, not trainmesh's
    assert "page.md:16" in shell[0] and "--no-such-flag is not in 'trainmesh train --help'" in shell[0]
    assert "page.md:17" in shell[1] and "no such subcommand" in shell[1]
    assert "page.md:18" in shell[2] and "--zero 5" in shell[2]
    assert "page.md:20" in shell[3] and "no-such-target" in shell[3]
