"""Every command line the docs show for our tools parses with the tool's own parser.

Docs and parsers drift apart silently: a renamed flag, a dropped choice, a subcommand the help
never mentions. Here every command line of README.md, docs/*.md and the tools' own docstrings
(fenced blocks, with ``\\`` continuations, and inline code spans) that runs one of this
repository's programs -- ``python -m dtensor_lite.plan [relayout]``, ``python examples/X.py``,
``torchrun ... examples/X.py`` -- is parsed, never run: by the program's ``build_parser()``, and
torchrun's part by torchrun's own parser. A program without ``build_parser`` takes no arguments.
Every documented torchrun command sets ``OMP_NUM_THREADS=1`` as README's does (otherwise torchrun
prints a 4-line notice before our first line). And each tool's ``--help`` names every subcommand,
choice and preset it accepts.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the tools whose docstrings show command lines (their --help prints part of them)
TOOL_SOURCES = [ROOT / "dtensor_lite" / "plan" / "__main__.py",
                ROOT / "dtensor_lite" / "plan" / "relayout_cli.py",
                *sorted((ROOT / "examples").rglob("*.py"))]
OUR_MODULES = ("dtensor_lite.plan",)  # `python -m` entry points of ours
ELIDED = "..."  # a doc's "the rest as you like": the command is checked up to there


def _shell_lines(block: str) -> list[str]:
    """A shell block's command lines, ``\\`` continuations joined, comments and prompts dropped."""
    lines, current = [], ""
    for raw in block.splitlines():
        line = raw.strip().removeprefix("$ ")
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return [l for l in lines if l and not l.startswith("#")]


def command_lines(text: str) -> list[str]:
    """Every candidate command line of a Markdown text or docstring: the lines of its fenced and
    indented blocks, and its inline code spans (a span may wrap over a line break)."""
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    found = [l for block in fence.findall(text) for l in _shell_lines(block)]
    rest = fence.sub("", text)
    found += [l for block in re.findall(r"(?:^(?: {4}|\t).*\n?)+", rest, re.M)
              for l in _shell_lines(block)]
    found += [" ".join(span.split()) for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", rest)]
    return [l for l in found if re.search(r"(^|\s)(python|torchrun)\s+\S", l)]


def invocations(line: str) -> list[tuple[list[str], list[str]]]:
    """``(environment assignments, argv)`` of each command a line runs (``a && b`` is two);
    a ``# comment`` after a command is dropped."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # unbalanced quotes: prose, not a command
        return []
    out, current = [], []
    for token in tokens + ["&&"]:
        if token in ("&&", ";", "||", "&"):
            env = [t for t in current[:_first_command(current)]]
            out.append((env, current[len(env):]))
            current = []
        else:
            current.append(token)
    return [(env, argv) for env, argv in out if argv and argv[0] in ("python", "torchrun")]


def _first_command(tokens: list[str]) -> int:
    i = 0
    while i < len(tokens) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[i]):
        i += 1
    return i


def program_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(our program, its arguments)`` for a ``python`` / ``torchrun`` argv that runs one of ours
    (a repository file or an entry point of OUR_MODULES), else None."""
    if argv[0] == "torchrun":
        if not any(a.endswith(".py") or a in ("-m", "--module") for a in argv):
            return None  # a mention of torchrun's options, not a command
        from torch.distributed.run import get_args_parser
        launch = get_args_parser().parse_args(argv[1:])
        script, args = launch.training_script, launch.training_script_args
        if launch.module:
            return (script, args) if script in OUR_MODULES else None
    elif argv[1:2] == ["-m"]:
        return (argv[2], argv[3:]) if argv[2] in OUR_MODULES else None
    else:
        script, args = argv[1], argv[2:]
    return (script, args) if (ROOT / script).is_file() else None


def build_parser_of(program: str, args: list[str]):
    """The parser that reads ``args`` for ``program`` (a subcommand's where the first argument
    names one), and the arguments it reads; None where the program takes no arguments."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    name = program + ".__main__" if program in OUR_MODULES else \
        ".".join(Path(program).with_suffix("").parts)   # examples/x.py -> examples.x
    module = importlib.import_module(name)
    subcommands = getattr(module, "SUBCOMMANDS", {})
    if args[:1] and args[0] in subcommands:
        return subcommands[args[0]][0](), args[1:]
    build = getattr(module, "build_parser", None)
    return (build() if build else None), args


def documented() -> list[tuple[str, list[str], list[str]]]:
    """``(where, environment assignments, argv)`` of every documented run of one of ours."""
    out = []
    for path in DOCS + TOOL_SOURCES:
        text = path.read_text()
        if path.suffix == ".py":  # the module docstring only: code may build argv lists too
            text = ast.get_docstring(ast.parse(text)) or ""
        for line in command_lines(text):
            for env, argv in invocations(line):
                out.append((f"{path.relative_to(ROOT)}: {' '.join(argv)}", env, argv))
    return out


DOCUMENTED = documented()


def test_the_docs_show_commands_of_every_kind():
    """The extraction finds what it must: a guard against a regex that silently finds nothing."""
    where = "\n".join(w for w, _, _ in DOCUMENTED)
    for expected in ("README.md: torchrun", "docs/scale.md: python -m dtensor_lite.plan --setup",
                     "docs/relayout.md: python -m dtensor_lite.plan relayout",
                     "docs/pipelining.md: torchrun", "examples/train_llama.py: python",
                     "examples/rl_weight_sync.py: torchrun"):
        assert expected in where, f"no documented command like {expected!r} found"


@pytest.mark.parametrize("where,env,argv", DOCUMENTED, ids=[w for w, _, _ in DOCUMENTED])
def test_documented_command_parses(where, env, argv):
    found = program_of(argv)
    if found is None:
        return  # torch's, pytest's or a placeholder like file.py: not ours to check
    program, args = found
    if ELIDED in args:
        args = args[:args.index(ELIDED)]
    parser, args = build_parser_of(program, args)
    if not args and parser is not None and any(a.required for a in parser._actions):
        return  # a program (or subcommand) named in prose, "`python -m dtensor_lite.plan` sizes"
    if parser is None:
        assert not args, f"{where}: {program} takes no arguments"
        return
    if ELIDED in found[1]:
        return  # the command's name (and subcommand) exist; the rest is the reader's
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}\n{program}'s parser refuses it:\n{stderr.getvalue()}")


@pytest.mark.parametrize("where,env,argv", [d for d in DOCUMENTED if d[2][0] == "torchrun"],
                         ids=[w for w, _, a in DOCUMENTED if a[0] == "torchrun"])
def test_documented_torchrun_sets_one_thread_per_process(where, env, argv):
    assert "OMP_NUM_THREADS=1" in env, (
        f"{where}: write OMP_NUM_THREADS=1 before torchrun as README.md does (else torchrun "
        "prints a notice before our first line)")


def test_the_extraction_joins_continuations_and_splits_chains():
    text = ("```bash\npip install -e . && OMP_NUM_THREADS=1 torchrun --standalone "
            "--nproc-per-node 4 \\\n    examples/train_llama.py --mesh tp=4   # TP\n```\n"
            "and `python -m dtensor_lite.plan\nrelayout --model example` inline\n")
    lines = command_lines(text)
    runs = [run for line in lines for run in invocations(line)]
    assert runs == [(["OMP_NUM_THREADS=1"], ["torchrun", "--standalone", "--nproc-per-node", "4",
                                              "examples/train_llama.py", "--mesh", "tp=4"]),
                    ([], ["python", "-m", "dtensor_lite.plan", "relayout", "--model", "example"])]
    assert program_of(runs[0][1]) == ("examples/train_llama.py", ["--mesh", "tp=4"])


def test_a_drifted_command_is_caught():
    """The check fails where it should: a flag the parser does not know."""
    parser, args = build_parser_of("examples/train_llama.py", ["--meshes", "tp=2"])
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parser.parse_args(args)


def _help(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())  # argparse wraps lines: compare words


@pytest.mark.parametrize("program", ["dtensor_lite.plan", "examples/train_llama.py",
                                     "examples/rl_weight_sync.py"])
def test_help_lists_every_subcommand_and_choice(program):
    parser, _ = build_parser_of(program, [])
    text = _help(parser)
    subcommands = getattr(importlib.import_module(program + ".__main__"), "SUBCOMMANDS", {}) \
        if program in OUR_MODULES else {}
    for name in subcommands:
        assert f"{program} {name}" in text, f"{program} --help does not name subcommand {name}"
    for p in [parser, *(build() for build, _, _ in subcommands.values())]:
        for action in p._actions:
            for choice in action.choices or ():
                assert str(choice) in _help(p), f"{p.prog} --help omits {action.dest}={choice}"
            if action.required:  # a required option is not shown as optional ([--x X])
                usage = " ".join(p.format_usage().split())
                assert f"[{action.option_strings[0]} " not in usage, \
                    f"{p.prog} --help shows the required {action.option_strings[0]} as optional"


def test_model_help_names_every_preset():
    from dtensor_lite.plan.presets import preset_names
    parser, _ = build_parser_of("dtensor_lite.plan", [])
    relayout, _ = build_parser_of("dtensor_lite.plan", ["relayout"])
    for p in (parser, relayout):
        for name in preset_names():
            assert name in _help(p), f"{p.prog} --help omits --model {name}"


def test_train_llama_mesh_help_names_every_mesh_dim():
    parser, _ = build_parser_of("examples/train_llama.py", [])
    mesh_help = next(a.help for a in parser._actions if a.dest == "mesh")
    from examples.train_llama import MESH_DIMS
    for dim in MESH_DIMS:
        assert re.search(rf"\b{dim}\b", mesh_help), f"--mesh help omits {dim}"
