"""The `selfspec` console script: argparse runs each subcommand's one plain function with its options.

Each command's options are a frozen dataclass whose fields are its flags (`selfspec.flags`: a field's
type, default and docstring make the flag), and the table in `_parser` maps each command's words onto
its function and that dataclass; `main` parses the flags into the dataclass and calls the function with
it. The functions and their options live where their work does.

    selfspec demo                                  # the whole pipeline on the embedded default
    selfspec recipes                               # the shipped training recipes
    selfspec pretrain --config embedded_base       # the embedded default's base model
    selfspec train --config demo_finetune          # layer dropout + early-exit losses (a recipe or a YAML)
    selfspec layers runs/base/model                # per-exit-layer agreement table (test split)
    selfspec eval gate --tuned runs/demo/model --base runs/base/model
    selfspec eval speedup --model runs/demo/model  # α, draft cost, tokens/s, speedups vs plain and HF
    selfspec eval sweep --model runs/demo/model --write-back   # fastest drafter setting into selfspec.json
    selfspec eval suite --model runs/demo/model --suite humaneval,stdlib   # per category, every method
    selfspec eval roofline --model runs/demo/model # passes against this machine's memory bandwidth
    selfspec generate runs/demo/model "def parse_args("
    selfspec draft-vocab runs/demo/model           # token frequencies for a trimmed draft head
    selfspec doctor runs/demo/model                # why it is (not) faster: probe and checklist
    selfspec serve runs/demo/model --port 8000     # an OpenAI-compatible server

A `UserError` (a bad flag, file, config or checkpoint) prints one line and exits 2; any other
exception is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from .cpu import one_heap

if sys.argv[1:2] == ["serve"]:
    # Before the imports below: one of them (pyarrow, under `datasets`) starts a thread that makes a
    # second glibc heap, which the server's threads would then be dealt out to, and a second heap's
    # free top is never returned to the kernel (`cpu.one_heap`).
    one_heap()

from . import commands, demo, recipes
from .commands import (
    DraftVocabOptions,
    ExportOptions,
    GateOptions,
    GenerateOptions,
    ImportGGUFOptions,
    LayersOptions,
)
from .data.distill_job import DistillOptions, distill_data
from .demo import DemoOptions
from .errors import UserError
from .evaluation import benchmark, doctor, roofline, suite, sweep
from .evaluation.options import (
    BenchmarkOptions,
    DoctorOptions,
    RooflineOptions,
    ServeLoadOptions,
    SuiteOptions,
    SweepOptions,
)
from .flags import Options, add_cli_args, from_cli_args, option
from .serving.options import ServeOptions
from .training import runs as training

# --------------------------------------------------------------------------------------------------
# The options of the commands that live here
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RecipesOptions(Options):
    """`selfspec recipes`."""

    path: str | None = option(None, metavar="NAME")
    """print this recipe's file (e.g. accelerate/ddp)"""


@dataclass(frozen=True, kw_only=True)
class RecipeOptions(Options):
    """A training command's recipe, its overrides and where its run goes."""

    config: str
    """a shipped recipe's name (`selfspec recipes`) or a YAML file (default {default})"""
    overrides: tuple[str, ...] = option((), positional=True, nargs="*")
    """field overrides such as optim.max_steps=100"""
    output_dir: str | None = None
    """the run's directory (default: the recipe's output_dir, under ./runs)"""
    resume: bool = False
    """continue from the last saved state in the run"""
    force: bool = False
    """replace a previous run in the output directory"""


@dataclass(frozen=True, kw_only=True)
class PretrainOptions(RecipeOptions):
    """`selfspec pretrain`."""

    config: str = "embedded_base"


@dataclass(frozen=True, kw_only=True)
class FinetuneOptions(RecipeOptions):
    """`selfspec train`."""

    config: str = "demo_finetune"


@dataclass(frozen=True, kw_only=True)
class CurveOptions(Options):
    """`selfspec eval curve`."""

    runs: tuple[str, ...] = option(positional=True, nargs="+")
    """training runs' output_dirs (each holds metrics.jsonl)"""
    exit_layer: int | None = None
    """with several runs: the exit to compare (default: the first run's selfspec.json)"""
    out: str = "runs/recipes.png"
    """with several runs: the PNG to write"""


def _generate(options: GenerateOptions):
    """`selfspec generate`: one prompt or a file of them (`commands.generate`)."""
    return commands.generate(options)


def _serve(options: ServeOptions) -> None:
    """`selfspec serve`: the OpenAI-compatible server (the optional extra selfspec[serve])."""
    try:
        from .serving.app import serve
    except ImportError as exc:
        raise UserError(f"the server needs {exc.name}: pip install 'selfspec[serve]'") from None
    serve(options)


def _serve_load(options: ServeLoadOptions) -> dict:
    """`selfspec eval serve-load` (needs the server's extra, selfspec[serve])."""
    try:
        from .evaluation.serve_load import serve_load
        from .serving import app  # noqa: F401 - fails here, with its name, when the extra is missing
    except ImportError as exc:
        raise UserError(f"the server needs {exc.name}: pip install 'selfspec[serve]'") from None
    return serve_load(options)


def _import_gguf(options: ImportGGUFOptions) -> Path:
    """`selfspec import-gguf` (`commands.import_gguf`)."""
    return commands.import_gguf(options.source, options.out, force=options.force)


def _recipes(options: RecipesOptions) -> None:
    """`selfspec recipes`: each shipped recipe's name and purpose, or (--path NAME) one recipe's file."""
    if options.path is not None:
        found = recipes.find(options.path)
        if found is None:
            near = recipes.closest(options.path)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise UserError(f"no shipped recipe is named {options.path!r}{hint}; "
                            f"`selfspec recipes` lists them")
        print(found)
        return
    shipped = recipes.shipped()
    width = max(len(r.name) for r in shipped)
    for recipe in shipped:
        print(f"{recipe.name:<{width}}  {recipe.purpose}")
    print("\nselfspec train --config NAME (or a YAML file of your own; `selfspec recipes --path NAME` "
          "prints a recipe's file to copy)")


def _pretrain(options: PretrainOptions) -> None:
    """`selfspec pretrain` (`training.runs.pretrain`)."""
    training.pretrain(options.config, list(options.overrides), options.resume, options.force,
                      options.output_dir)


def _finetune(options: FinetuneOptions) -> None:
    """`selfspec train` (`training.runs.finetune`)."""
    training.finetune(options.config, list(options.overrides), options.resume, options.force,
                      options.output_dir)


def _curve(options: CurveOptions) -> None:
    """`selfspec eval curve`: one run's curve.png, or several runs' acceptance at one exit on one PNG."""
    from .checkpoint import read_meta
    from .evaluation.curves import plot_runs, read_curve, write_curve

    runs = options.runs
    if len(runs) == 1:
        print(f"wrote {write_curve(runs[0])}")
        return
    exit_layer = options.exit_layer or read_meta(Path(runs[0]) / "model")["exit_layer"]
    print(f"wrote {plot_runs({run: read_curve(run) for run in runs}, exit_layer, options.out)}")


def _parser() -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], argparse.ArgumentParser]]:
    """The top parser and each command's own parser (its words -> parser): the table of commands, each
    its function, its options dataclass (the flags) and its help. Each parser sets `func` and
    `options_class`."""
    parser = argparse.ArgumentParser(prog="selfspec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    table = {}

    def command(words: tuple[str, ...], subparsers, func, options, **kwargs) -> argparse.ArgumentParser:
        """A command's parser, its flags the fields of `options` (a dataclass)."""
        p = subparsers.add_parser(words[-1], **kwargs)
        p.set_defaults(func=func, options_class=options)
        add_cli_args(p, options)
        table[words] = p
        return p

    command(("demo",), sub, demo.run, DemoOptions,
            help="run the pipeline on the embedded default (or, --smollm2, on a real model)")
    command(("recipes",), sub, _recipes, RecipesOptions,
            help="the shipped training recipes, each with its purpose")
    command(("pretrain",), sub, _pretrain, PretrainOptions,
            help="pretrain a base model (the embedded default); reused when trained with the same config")
    command(("train",), sub, _finetune, FinetuneOptions,
            help="self-speculative fine-tune: layer dropout and early-exit losses "
                 "(also under `accelerate launch -m selfspec train`)")

    command(("import-gguf",), sub, _import_gguf, ImportGGUFOptions,
            help="dequantise a .gguf file (or a package shipping one) into a model dir")
    command(("export",), sub, commands.export, ExportOptions,
            help="write a tuned exit as a standalone draft model of the same family (Hugging Face's "
                 "assisted generation, vLLM's and llama.cpp's draft models)")
    command(("draft-vocab",), sub, commands.draft_vocab_counts, DraftVocabOptions,
            help="count token frequencies into a checkpoint (for a trimmed draft head)")
    command(("distill-data",), sub, distill_data, DistillOptions,
            help="the model's own replies to chat prompts (cached, resumable), a chat .jsonl for the "
                 "fine-tune")
    command(("doctor",), sub, doctor.doctor, DoctorOptions,
            help="why the model does or does not decode faster: a short probe and the checklist")
    command(("layers",), sub, commands.layers_report, LayersOptions,
            help="per-exit-layer agreement with the final layer")
    command(("generate",), sub, _generate, GenerateOptions, help="generate with a tuned checkpoint")
    command(("serve",), sub, _serve, ServeOptions,
            help="an OpenAI-compatible server (chat and text completions) that decodes self-speculatively")

    ev = sub.add_parser("eval", help="evaluations: gate, speedup, suite, sweep, roofline, curve")
    ev = ev.add_subparsers(dest="eval_command", required=True)
    command(("eval", "gate"), ev, commands.gate, GateOptions,
            help="perplexity regression gate (exit code 1 when it fails)")
    command(("eval", "speedup"), ev, benchmark.speedup, BenchmarkOptions,
            help="decoding benchmark: plain vs self-speculative vs Hugging Face's generators")
    command(("eval", "suite"), ev, suite.suite, SuiteOptions,
            help="every method on a multi-task suite, per category: speedups over Hugging Face greedy and "
                 "own plain, tokens per pass, α")
    command(("eval", "roofline"), ev, roofline.run, RooflineOptions,
            help="memory bandwidth, bytes per pass, and the plain step, draft step and verification of 1..8 "
                 "positions measured against them")
    command(("eval", "sweep"), ev, sweep.sweep, SweepOptions,
            help="speedup over a grid of drafters, exit layers E and draft lengths k; plot; the fastest into "
                 "selfspec.json")
    command(("eval", "serve-load"), ev, _serve_load, ServeLoadOptions,
            help="the server under load: throughput, time to the first token and inter-token latency at "
                 "several concurrencies, against itself without drafting; --fault: hostile requests")
    command(("eval", "curve"), ev, _curve, CurveOptions,
            help="acceptance at the exits and perplexity vs training tokens (curve.png); several runs: their "
                 "acceptance at one exit vs tokens and minutes on one PNG")
    return parser, table


def main(argv: list[str] | None = None) -> int:
    """Run one command; 0 on success, 1 when a gate fails, 2 for a user mistake (one line on stderr)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, table = _parser()
    words = tuple(argv[:2]) if argv[:1] == ["eval"] else tuple(argv[:1])
    if words not in table:  # no or an unknown command, or --help: argparse says so
        parser.parse_args(argv)
        return 2
    # Intermixed: `generate MODEL --chat "a question"` puts an optional between the two positionals.
    args = table[words].parse_intermixed_args(argv[len(words):])
    func, options_class = args.func, args.options_class
    from .cpu import keep_freed_memory

    keep_freed_memory()  # the commands run (tokens, vocabulary) logits blocks: see selfspec.cpu
    try:  # the options check their values as they are made: a bad one is a UserError too
        result = func(from_cli_args(args, options_class))
    except UserError as exc:  # a user mistake: one line, no traceback; anything else is a bug
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    return 1 if result is False else 0


if __name__ == "__main__":
    sys.exit(main())
