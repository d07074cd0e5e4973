"""Options declared once: a command's options are a frozen dataclass, and its flags are derived from it.

A field's name, type, default and docstring make its flag: `max_new_tokens: int = 128` with the
docstring under it is `--max-new-tokens N` (type int, default 128, that help). `option(...)` adds what
a type cannot say: a positional, another spelling (`--data` for `data`), choices, a metavar, a flag
that repeats, flags that exclude each other. `add_cli_args` adds a dataclass's flags to a parser,
`from_cli_args` reads the parsed flags back into it, and `to_cli_args` writes an instance as the flags
that make it again. As vLLM derives its CLI from `EngineArgs`.

Option groups are small frozen dataclasses; a command's options inherit the groups it takes (one
flat object, as the Python API wants it: `BenchmarkOptions(model="runs/demo/model", repeats=3)`), and
a command that wants another default for a group's field declares that field again (its docstring
stays the group's). `Options.__post_init__` runs every class's own `check` in the hierarchy, so a
bad value is a `UserError` of one line whether it came from a flag or from Python.

A docstring is the flag's help as written, `%` included; `{NAME}` in it is the value of `NAME` in the
module that defines the field (a tuple's or a dict's items joined with ", "), `{default}` the field's
default.

The groups here are the ones the commands share across the package: the decode settings a command
may override (`DecodeSettings.override`'s fields), structured output's constraint, the static passes.
"""

from __future__ import annotations

import argparse
import ast
import collections.abc
import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from .decoding import DRAFTERS, parse_num_speculations
from .sampling import SamplingParams


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line beyond what its name, type and default say."""

    name: str | None = None  # the flag as typed when it is not --field-name
    positional: bool = False
    nargs: str | None = None  # a positional's "?", "*" or "+"
    choices: tuple | None = None
    metavar: str | None = None
    append: bool = False  # the flag repeats, each use adds one value to a list
    exclusive: str | None = None  # the fields that share this name exclude each other
    cli: bool = True  # False: a field of the Python API only


def option(default: Any = MISSING, *, flag: str | None = None, positional: bool = False,
           nargs: str | None = None, choices=None, metavar: str | None = None, append: bool = False,
           exclusive: str | None = None, cli: bool = True):
    """A dataclass field with its `Flag` (see the module docstring); no `default`: a required option."""
    spec = Flag(flag, positional, nargs, None if choices is None else tuple(choices), metavar, append,
                exclusive, cli)
    return dataclasses.field(default=default, metadata={"flag": spec})


@dataclass(frozen=True, kw_only=True)
class Options:
    """The base of every options dataclass: its construction runs the checks of each class it is made of."""

    def __post_init__(self):
        for klass in reversed(type(self).__mro__):  # the groups' checks first, the command's last
            check = vars(klass).get("check")
            if check is not None:
                check(self)

    def _normalize(self, **values) -> None:
        """Store `values` in place of the fields' given forms (a comma list read into a tuple): for
        `check`, on a frozen instance."""
        for name, value in values.items():
            object.__setattr__(self, name, value)


def flag_of(field: dataclasses.Field) -> Flag:
    """The field's `Flag` (a plain field: the defaults)."""
    return field.metadata.get("flag", Flag())


def cli_fields(cls) -> list[dataclasses.Field]:
    """The fields of options class `cls` that are flags, in the order their flags are added."""
    by_name = {f.name: f for f in dataclasses.fields(cls) if flag_of(f).cli}
    # the command's own fields first, then each group's, in the order the class names its bases
    names = dict.fromkeys(name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})
                          if name in by_name)
    fields = [by_name[name] for name in names]
    # positionals in their declared order, first: argparse takes them in the order they were added
    return [f for f in fields if flag_of(f).positional] + [f for f in fields if not flag_of(f).positional]


def flag_name(field: dataclasses.Field) -> str:
    """The field's flag as typed: `--max-new-tokens`, `--data`, or a positional's name."""
    spec = flag_of(field)
    return field.name if spec.positional else spec.name or "--" + field.name.replace("_", "-")


@functools.cache
def _class_nodes(module: str) -> dict[str, ast.ClassDef]:
    """The classes a module defines, by name, as its source parses (once per module: the CLI reads the
    docstrings of every command's options as it starts)."""
    try:
        source = inspect.getsource(sys.modules[module])
    except (OSError, TypeError):  # no source (a frozen application): flags without help
        return {}
    return {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)}


@functools.cache
def _docstrings(cls) -> dict[str, tuple[str, dict]]:
    """{field: (its docstring, the globals of the module that defines it)} over `cls` and its bases (a
    subclass's docstring wins; a field declared again without one keeps its base's)."""
    docs: dict[str, tuple[str, dict]] = {}
    for klass in reversed(cls.__mro__):
        node = _class_nodes(klass.__module__).get(klass.__name__) if dataclasses.is_dataclass(klass) else None
        if node is None:
            continue
        names = vars(sys.modules[klass.__module__])
        for field, after in zip(node.body, node.body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[field.target.id] = (" ".join(after.value.value.split()), names)
    return docs


def field_doc(cls, field: dataclasses.Field) -> str | None:
    """The field's docstring with its `{NAME}`s filled in (see the module docstring); None: none."""
    doc, names = _docstrings(cls).get(field.name, (None, {}))
    if doc is None:
        return None

    def value(match: re.Match) -> str:
        name = match.group(1)
        found = field.default if name == "default" else names.get(name, match.group(0))
        return ", ".join(map(str, found)) if isinstance(found, (tuple, list, dict)) else str(found)

    return re.sub(r"\{(\w+)\}", value, doc)


def _members(hint) -> list:
    """The types a field may hold, None left out (`int | None` -> [int])."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return [hint]


def _converter(members: list):
    """The argparse `type` of a flag whose field holds `members`: int or float where that is all it
    holds (as a list's items too); None (the text as typed) where it may hold a string."""
    items, words = [], []
    for member in members:
        origin = typing.get_origin(member)
        if origin in (list, tuple, collections.abc.Sequence):
            items += [arg for arg in typing.get_args(member) if arg is not Ellipsis]
        elif origin is Literal:
            words += [arg for arg in typing.get_args(member) if isinstance(arg, str)]
        else:
            items.append(member)
    if str in items or not items:
        return None
    number = int if all(item is int for item in items) else float if float in items else None
    if number is None or not words:
        return number

    def number_or_word(text: str):  # `int | Literal["auto"]`: "auto" as typed, else the number
        return text if text in words else number(text)

    number_or_word.__name__ = f"{number.__name__} or {' / '.join(words)}"  # argparse's "invalid ... value"
    return number_or_word


def add_cli_args(parser: argparse.ArgumentParser, cls) -> argparse.ArgumentParser:
    """Add the flags of options class `cls` to `parser` (see the module docstring). Argparse holds no
    default: a flag not given is left out of the namespace, and the dataclass's default applies."""
    hints = typing.get_type_hints(cls)
    exclusive: dict[str, Any] = {}
    for field in cli_fields(cls):
        spec, members = flag_of(field), _members(hints[field.name])
        kwargs: dict[str, Any] = {"help": (field_doc(cls, field) or "").replace("%", "%%") or None,
                                  "default": argparse.SUPPRESS}
        if members == [bool]:  # a switch; a field that may be None too (keep the setting) has --no-X
            kwargs["action"] = "store_true" if field.default is False else argparse.BooleanOptionalAction
        else:
            converter = _converter(members)
            if converter is not None:
                kwargs["type"] = converter
            # a Literal's values are the choices where the field holds nothing else
            literal = all(typing.get_origin(m) is Literal for m in members)
            choices = spec.choices or (typing.get_args(members[0]) if literal and len(members) == 1 else None)
            if choices:
                kwargs["choices"] = choices
            if spec.append:
                kwargs["action"] = "append"
        if spec.metavar:
            kwargs["metavar"] = spec.metavar
        if spec.positional:
            if spec.nargs:
                kwargs["nargs"] = spec.nargs
        else:
            kwargs["dest"] = field.name
            if field.default is MISSING and field.default_factory is MISSING:
                kwargs["required"] = True
        target = parser
        if spec.exclusive:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = parser.add_mutually_exclusive_group()
            target = exclusive[spec.exclusive]
        target.add_argument(flag_name(field), **kwargs)
    return parser


def from_cli_args(namespace: argparse.Namespace, cls):
    """The options of class `cls` from a namespace its flags (`add_cli_args`) were parsed into."""
    given = vars(namespace)
    return cls(**{f.name: given[f.name] for f in cli_fields(cls) if f.name in given})


def to_cli_args(options: Options) -> list[str]:
    """The flags that make `options` again through `add_cli_args` / `from_cli_args`: positionals
    first, then each field whose value is not its default."""
    argv: list[str] = []
    for field in cli_fields(type(options)):
        value, spec, name = getattr(options, field.name), flag_of(field), flag_name(field)
        if spec.positional:
            if value is not None:  # an optional positional left out
                argv += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
        elif field.default is not MISSING and value == field.default:
            continue
        elif isinstance(value, bool):
            argv.append(name if value else "--no-" + name[2:])
        elif spec.append:
            argv += [part for item in value for part in (name, str(item))]
        elif isinstance(value, (list, tuple)):
            argv += [name, ",".join(map(str, value))]
        elif value is not None:
            argv += [name, str(value)]
    return argv


# --------------------------------------------------------------------------------------------------
# The groups that commands across the package share
# --------------------------------------------------------------------------------------------------

OVERRIDES = ("drafter", "exit_layer", "num_speculations", "draft_vocab_size", "stop_below", "min_ngram",
             "overlap", "fused")  # `DecodeSettings.override`'s keywords


@dataclass(frozen=True, kw_only=True)
class DecodeOverrides(Options):
    """The decode settings a command may override (default: the checkpoint's selfspec.json)."""

    exit_layer: int | None = None
    """E: blocks the draft runs"""
    num_speculations: int | str | None = None
    """k: an integer, auto or window"""
    draft_vocab_size: int | None = None
    """V': the early exit drafts among the V' most frequent tokens (0: all)"""
    stop_below: float | None = None
    """η: stop a round's early-exit drafts when the draft's top probability falls below it (0: never)"""
    overlap: bool | None = None
    """verify each round on one thread while another drafts the next (CPU, greedy, one row; pays where
    one thread runs a pass nearly as fast as all)"""
    fused: bool | None = None
    """run a lone row's rounds many in one compiled call (CPU); false: each round from Python"""

    def check(self):
        if self.num_speculations is not None:  # "3" as typed -> 3; a bad k fails before anything loads
            self._normalize(num_speculations=parse_num_speculations(self.num_speculations))

    def overrides(self) -> dict:
        """The given fields as `DecodeSettings.override`'s keywords (None keeps a field), those of the
        `DrafterOverride` and `CopyOverride` groups too when the options have them."""
        return {name: getattr(self, name, None) for name in OVERRIDES}


@dataclass(frozen=True, kw_only=True)
class DrafterOverride(Options):
    """The drafter a command may choose (the benchmark has none: each of its engine methods is one)."""

    drafter: str | None = option(None, choices=DRAFTERS)
    """early_exit, ngram (copies from the context) or hybrid"""


@dataclass(frozen=True, kw_only=True)
class CopyOverride(Options):
    """The copy drafter's threshold."""

    min_ngram: int | None = None
    """shortest context match that copies"""


@dataclass(frozen=True, kw_only=True)
class ConstraintOptions(Options):
    """Structured output: what constrains every reply (one of them)."""

    json_schema: str | None = option(None, metavar="FILE", exclusive="constraint")
    """replies are JSON valid under this JSON schema"""
    regex: str | None = option(None, exclusive="constraint")
    """replies match this regular expression"""
    grammar: str | None = option(None, metavar="FILE", exclusive="constraint")
    """replies follow this Lark grammar (.lark)"""

    def constraint(self):
        """The `Constraint` the fields name (files read, the grammar checked), or None."""
        from .decoding.grammar import read_constraint

        return read_constraint(json_schema=self.json_schema, regex=self.regex, grammar=self.grammar)


@dataclass(frozen=True, kw_only=True)
class SamplingOptions(Options):
    """How a command's decodes sample: `sampling.SamplingParams` and the seed of its random numbers."""

    temperature: float = 0.0
    """0: greedy; else sample at this temperature (an OpenAI client that sends none gets 1.0)"""
    top_k: int = 0
    """sample from the k most likely tokens (0: all)"""
    top_p: float = 1.0
    """nucleus sampling: the smallest set of most likely tokens whose mass reaches it (1: all)"""
    seed: int | None = None
    """the seed of the sampled rows' random numbers (row i: seed + i; default 0 where a command times or
    compares decodes, else drawn)"""

    def check(self):
        self.sampling()  # a bad value is a one-line UserError

    def sampling(self) -> SamplingParams:
        """The fields as `SamplingParams`."""
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def sampling_keywords(self, seed: int | None = None) -> dict:
        """`generate`'s keywords for these settings (`seed` where the options give none)."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed if self.seed is not None else seed}


@dataclass(frozen=True, kw_only=True)
class StaticPassesOption(Options):
    """How the engine runs its passes: the backend (`SelfSpecGenerator(backend=...)`) and the static
    passes' mode (`static_passes=...`)."""

    backend: Literal["auto", "reference", "cpu_kernels", "static"] = "auto"
    """how the round's passes run: reference = torch operations (the oracle, any device); cpu_kernels =
    selfspec's compiled CPU calls; static = fixed shapes (see --static-passes); auto: static with
    --static-passes, else cpu_kernels on a CPU and reference elsewhere"""
    static_passes: Literal["eager", "graph"] | None = None
    """run every decoding pass at fixed shapes: graph = each pass (a round's k drafts, its verification)
    captured as one CUDA graph (Llama family; first calls capture); eager = the same passes as written"""


__all__ = ["ConstraintOptions", "CopyOverride", "DecodeOverrides", "DrafterOverride", "Flag", "Options",
           "SamplingOptions", "StaticPassesOption", "add_cli_args", "cli_fields", "field_doc", "flag_name",
           "from_cli_args", "option", "to_cli_args"]
