"""The package's commands as plain functions, called with keywords by the CLI (`cli.py`), the demo
(`demo.py`) and anyone's script: agreement per exit layer, the perplexity gate, token counts for a
trimmed draft head, generation, distillation data and the GGUF import. (The speed benchmark and the
sweep are `evaluation.benchmark.speedup` and `evaluation.sweep.sweep`.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .checkpoint import META_FILE, checkpoint_adapters, draft_vocab, read_meta
from .decoding import DecodeSettings
from .errors import UserError
from .export import describe, export_draft
from .files import write_json_atomic


def eval_blocks(model_dir: str, source: str = "stdlib", split: str = "test", block_size: int = 256,
                max_blocks: int | None = 64, cache_dir: str | None = None,
                tokenizer_dir: str | None = None):
    """Held-out blocks of `split`, tokenized with the model's tokenizer: (input_ids (n, block_size),
    target_mask (n, block_size) for chat data, where only the assistant tokens count, else None)."""
    from . import data
    from .cache import cache_dir as user_cache_dir
    from .model.loading import load_tokenizer

    cache_dir = cache_dir or user_cache_dir()
    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    corpus = data.load_corpus(source, cache_dir=cache_dir)
    if split not in corpus:
        raise UserError(f"split {split!r} is not in the data; choose one of {', '.join(corpus)}")
    return data.block_tensors(data.pack_split(corpus[split], tokenizer, block_size, max_blocks=max_blocks,
                                              cache_dir=cache_dir))


def layers_report(model_dir: str, source: str = "stdlib", split: str = "test", block_size: int = 256,
                  max_blocks: int = 64, json_out: str | None = None) -> dict:
    """Training-free acceptance picture: every exit layer's agreement with the final layer."""
    from .agreement import exit_layer_metrics
    from .evaluation.exits import format_exit_table
    from .model.loading import load_causal_lm

    model = load_causal_lm(model_dir).eval()
    blocks, mask = eval_blocks(model_dir, source, split, block_size, max_blocks)
    # A checkpoint's draft reads its exits through its adapter and its trimmed head: measure that draft.
    meta = read_meta(model_dir) if (Path(model_dir) / META_FILE).is_file() else {}
    adapter = meta.get("exit_adapter")
    adapters = checkpoint_adapters(model_dir, model, meta) if meta else None
    vocab = draft_vocab(model_dir, meta["draft_vocab_size"]) if meta.get("draft_vocab_size") else None
    report = exit_layer_metrics(model, blocks, progress=True, target_mask=mask, exit_adapters=adapters,
                                draft_vocab=vocab)
    print(f"{model_dir}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(report)} layers; {split} split, {report[max(report)]['tokens']:,} target tokens"
          + (f"; exits drafted over V' = {len(vocab):,} ids" if vocab is not None else "")
          + (f"; exit {adapter['exit_layer']} through its adapter" if adapter else ""))
    print(format_exit_table(report))
    if json_out:
        write_json_atomic(json_out, {str(k): v for k, v in report.items()})
    return report


def gate(tuned: str, base: str, max_increase: float = 0.01, source: str = "stdlib", split: str = "test",
         block_size: int = 256, max_blocks: int = 64, json_out: str | None = None) -> bool:
    """Perplexity regression gate, tuned vs base; returns whether it passed."""
    from .evaluation.perplexity import perplexity_gate
    from .model.loading import load_causal_lm

    blocks, mask = eval_blocks(base, source, split, block_size, max_blocks)
    result = perplexity_gate(load_causal_lm(tuned).eval(), load_causal_lm(base).eval(), blocks, max_increase,
                             target_mask=mask)
    print(result.summary())
    if json_out:
        write_json_atomic(json_out, result.to_dict())
    return result.passed


def draft_vocab_counts(model_dir: str, source: str = "stdlib", split: str = "train", block_size: int = 256,
                       max_blocks: int | None = None,
                       sizes=(256, 512, 1024, 2048, 4096, 8192, 16384)) -> dict:
    """Count token frequencies on a corpus with the model's tokenizer and store them in the checkpoint
    (token_counts.safetensors): the ranking of a trimmed draft head. Prints how much of the corpus
    the V' most frequent tokens cover, for each V' in `sizes` below the vocabulary."""
    from transformers import AutoConfig

    from .checkpoint import save_token_counts
    from .data import count_tokens
    from .decoding.draft_head import coverage

    read_meta(model_dir)  # a checkpoint, or a clear error before any counting
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    counts = count_tokens(eval_blocks(model_dir, source, split, block_size, max_blocks)[0], vocab_size)
    summary = save_token_counts(model_dir, counts, f"{source}, {split} split")
    shares = coverage(counts, [v for v in sizes if v < vocab_size])
    print(f"{model_dir}: counted {summary['tokens']:,} tokens of {source} ({split}); "
          f"{int((counts > 0).sum()):,} of {vocab_size:,} token ids occur")
    for size, share in shares.items():
        print(f"  V' = {size:>6,}: {share:.1%} of the tokens")
    return {"counts": summary, "coverage": shares}


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a "prompt" or "text" field."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompt file {path!r} does not exist; "
                        f"pass a text file (one prompt per line) or .jsonl")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if file.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{number} is not valid JSON; write one object per line") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise UserError(f'{path}:{number} has no "prompt" or "text" string field')
            prompts.append(text)
        lines = prompts
    if not lines:
        raise UserError(f"prompt file {path!r} holds no prompt")
    return lines


def generate(model_dir: str, prompts: list[str], *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
             eos: list[int] | None = None, stop: list[str] | None = None, stream: bool = True,
             exit_layer: int | None = None, num_speculations=None, drafter: str | None = None,
             draft_vocab_size: int | None = None, stop_below: float | None = None,
             overlap: bool | None = None, json_schema: str | None = None, regex: str | None = None,
             grammar: str | None = None, static_passes: str | None = None) -> list[str] | bool:
    """Generate continuations of `prompts` (one batch) with a tuned checkpoint; print them and the stats.

    It decodes at the checkpoint's `DecodeSettings` (a sweep's `--write-back` sets them); E, k, the
    drafter and V' override single fields. `chat` wraps each prompt in the tokenizer's chat template
    as one user turn (instruct models). `eos`: token ids that end a row (default the model's; an
    empty list never stops early); `stop`: strings that end a row. A single prompt streams its tokens
    as they are accepted; a batch prints each row in order, rows separated by a line holding `---`.
    Structured output: `json_schema` (a JSON file) or `grammar` (a Lark file) or `regex` constrains
    every row; a row that max_new_tokens cuts before its grammar is complete is reported on stderr
    and the result is False (exit code 1), never passed off as valid.
    """
    from transformers import TextStreamer

    from .checkpoint import load_tuned
    from .decoding.grammar import read_constraint

    if not prompts or any(not p for p in prompts):
        raise UserError("a prompt is empty; pass some text to continue")
    constraint = read_constraint(json_schema=json_schema, regex=regex, grammar=grammar)
    gen = load_tuned(model_dir, exit_layer=exit_layer, num_speculations=num_speculations, drafter=drafter,
                     draft_vocab_size=draft_vocab_size, stop_below=stop_below, overlap=overlap,
                     static_passes=static_passes)
    tokenizer = gen.tokenizer
    if tokenizer is None:
        raise UserError(f"{model_dir} has no tokenizer; "
                        f"save one beside the model (tokenizer.save_pretrained)")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"{model_dir}'s tokenizer has no chat template; drop --chat for a plain continuation")
    texts_in = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) if chat else p for p in prompts]
    ids = [tokenizer(t, add_special_tokens=not chat)["input_ids"] for t in texts_in]
    live = stream and len(prompts) == 1
    if live and not chat:
        print(prompts[0], end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=chat) if live else None
    out = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=seed, eos_token_id=eos, stop_strings=stop or None, streamer=streamer,
                       **(constraint.keywords() if constraint else {}))
    texts = [tokenizer.decode(seq, skip_special_tokens=chat) for seq in out.sequences]
    if not live:
        print("\n---\n".join(t if chat else p + t for p, t in zip(prompts, texts)))
    stats = out.stats
    forced = f"forced {stats.forced.accepted}/{stats.forced.drafted}, " if out.complete is not None else ""
    print(f"\n[{gen.settings.describe()}: acceptance rate {stats.acceptance_rate:.3f} ({forced}copied "
          f"{stats.copy.accepted}/{stats.copy.drafted}, early exit {stats.early_exit.accepted}/"
          f"{stats.early_exit.drafted} drafts accepted), "
          f"mean accepted length {stats.mean_accepted_length:.2f}, "
          f"{stats.tokens_per_second:.1f} tokens/s]", file=sys.stderr)
    incomplete = [row for row, done in enumerate(out.complete or []) if not done]
    if incomplete:
        rows = ", ".join(str(r + 1) for r in incomplete)
        print(f"error: the output of prompt {rows} does not complete its grammar within --max-new-tokens "
              f"{max_new_tokens}; raise --max-new-tokens", file=sys.stderr)
        return False
    return texts


def distill_data(model_dir: str, prompts: str, out: str, *, limit: int | None = None, batch_size: int = 8,
                 max_new_tokens: int = 256, max_prompt_tokens: int = 512, temperature: float = 0.0,
                 seed: int = 0,
                 drafter: str = "ngram", force: bool = False) -> dict:
    """The model's own replies to `prompts` into `out/responses.jsonl` (see `selfspec.data.distill`)."""
    from .checkpoint import load_tuned
    from .data.distill import distill_prompts, distill_responses

    pairs = distill_prompts(prompts, read_prompt_file)[:limit]
    generator = load_tuned(model_dir, drafter=drafter, num_speculations="auto")
    summary = distill_responses(generator, pairs, out, model_name=str(model_dir), batch_size=batch_size,
                                max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                temperature=temperature, seed=seed, force=force)
    print(f"{summary['file']}: {summary['rows']} replies ({summary['new_rows']} new, "
          f"{summary['tokens']:,} tokens in {summary['seconds']} s); "
          f"{summary['skipped_long']} prompts over {max_prompt_tokens} tokens skipped")
    return summary


def export(model_dir: str, draft: str, exit_layer: int | None = None, force: bool = False) -> Path:
    """`selfspec export MODEL --draft OUT`: the tuned exit as a standalone draft model (`export.py`)."""
    out = export_draft(model_dir, draft, exit_layer=exit_layer, force=force)
    print(describe(out))
    return out


def import_gguf(source: str, out: str, force: bool = False) -> Path:
    """Dequantise a GGUF file (or the one an installed package ships) into a model directory."""
    from .checkpoint import save_tuned
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
    save_tuned(out_path, model, tokenizer, settings=settings, base_model=str(path), kind="base",
               metrics={"parameters": parameters})
    print(f"imported {path.name} -> {out}: {model.config.model_type}, {num_layers} layers, "
          f"{model.config.vocab_size:,}-token vocabulary, {parameters:,} parameters (fp32)")
    return out_path
