"""Speed benchmark: the engine plain vs self-speculative vs Hugging Face's generators, in one process.

Ways to decode the same prompts greedily, batch 1, the same number of new tokens:

- ``plain``: `SelfSpecGenerator.generate(num_speculations=0)`, the same engine, one full forward per
  token on the same cache: the fair baseline;
- ``selfspec``: the engine's early-exit drafts at (exit_layer E, num_speculations k or "auto");
- ``ngram``: the engine drafting only by copying from the context (n-gram lookup), plain steps
  when nothing matches: prompt lookup on selfspec's engine;
- ``hybrid``: copies when the context has a match, early-exit drafts otherwise (`decoding/policy.py`);
- ``hf_greedy``: `model.generate(do_sample=False)`;
- ``hf_early_exit``: `model.generate(assistant_early_exit=E)`, Hugging Face's self-speculation: its
  `EarlyExitCandidateGenerator` drafts by temporarily lowering `config.num_hidden_layers` to E and
  keeps a separate assistant cache, so the draft blocks run again during verification (batch 1 only;
  GPT-2 ignores `num_hidden_layers`, so there the "draft" is the whole model);
- ``hf_prompt_lookup``: `model.generate(prompt_lookup_num_tokens=10)`, Hugging Face's prompt lookup
  decoding: drafts copied from the context by n-gram matching, free to propose, verified by the full
  model (batch 1 only). The tool a user would otherwise pick for code and other repetitive text.

Timing: `warmup` untimed passes, then `repeats` rounds; inside a round every prompt is decoded by
every method, the method order rotating from round to round (interleaved, so drift in clocks or
thermals hits all methods alike). Each method's tokens/s is the median over rounds of (tokens of all
prompts ÷ their summed wall time, device synchronised). Speedups are ratios of medians.

Reported next to the measured speedup: α, mean accepted length (bonus counted), the draft cost c
measured as (engine's draft time per step in the selfspec run) ÷ (engine's time per plain step in the
plain run), and the cost model's predictions from those (see `selfspec.metrics`). Greedy outputs of
every method but hf_early_exit must be identical; hf_early_exit's are checked and
reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checkpoint import META_FILE, exit_adapter_for, read_meta
from ..checkpoint import draft_vocab as checkpoint_draft_vocab
from ..decoding import NGramConfig, SelfSpecGenerator, make_policy
from ..metrics import AcceptanceStats, predicted_speedup, speedup_kv_reuse, speedup_measured_costs
from ..model.loading import load_causal_lm, load_tokenizer
from .report import write_report as write_files

METHODS = ("plain", "selfspec", "ngram", "hybrid", "hf_greedy", "hf_early_exit", "hf_prompt_lookup")
ENGINE_METHODS = {"plain": "early_exit", "selfspec": "early_exit", "ngram": "ngram", "hybrid": "hybrid"}  # -> drafter
HF_BATCH1_METHODS = ("hf_early_exit", "hf_prompt_lookup")  # Hugging Face's assisted generation: batch 1 only
PROMPT_LOOKUP_TOKENS = 10  # Hugging Face's documented example value


def load_model(path: str, device: str | None = None, dtype: str = "auto"):
    """`AutoModelForCausalLM` + `AutoTokenizer` from `path` in eval mode, on CUDA when there is one.

    dtype "auto": float32 on CPU, the checkpoint's own dtype on accelerators.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(path, dtype=dtype, device=device).eval()
    return model, load_tokenizer(path)


def prompts_from_corpus(tokenizer, source: str = "stdlib", num_prompts: int = 8, prompt_tokens: int = 64,
                        split: str = "test", text_field: str = "text") -> list[list[int]]:
    """`prompt_tokens` tokens from the middle of each of the first `num_prompts` documents of a split.

    The middle, not the start: the first tokens of source files are mostly license headers and
    module docstrings, while the workload is completing code in the middle of a file.
    source: anything `selfspec.data.load_text_corpus` takes ("stdlib", files, a dataset name).
    Documents shorter than 2 x `prompt_tokens` tokens are skipped.
    """
    from ..data import load_text_corpus

    prompts = []
    for text in load_text_corpus(source, text_field=text_field)[split][text_field]:
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= 2 * prompt_tokens:
            middle = len(ids) // 2
            prompts.append(ids[middle - prompt_tokens:middle])
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no document of {source!r} split {split!r} has {2 * prompt_tokens} tokens or more")
    return prompts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class EngineSetting:
    """How an engine method decodes: E, the early exit's k, the draft head's token ids, copy settings."""

    exit_layer: int
    num_speculations: int | str = 4
    draft_vocab: tuple | None = None  # token ids of a trimmed draft head; None: the whole head
    ngram: NGramConfig = field(default_factory=NGramConfig)

    def describe(self) -> dict:
        return {"exit_layer": self.exit_layer, "num_speculations": self.num_speculations,
                "draft_vocab_size": None if self.draft_vocab is None else len(self.draft_vocab),
                "ngram": self.ngram.as_dict()}


class _Runner:
    """Runs one method on one prompt: returns the generated tokens and, for the engine, its stats."""

    def __init__(self, model, tokenizer, settings: dict[str, EngineSetting], max_new_tokens: int, ignore_eos: bool,
                 exit_adapters: dict | None = None):
        self.model, self.settings = model, settings
        self.generators: dict = {}  # (E, draft vocab) -> SelfSpecGenerator, shared by the methods that match
        for setting in settings.values():
            key = (setting.exit_layer, setting.draft_vocab)
            if key not in self.generators:
                # check_cache off, as in the sweep: a timed run does no per-round bookkeeping (tests check caches)
                self.generators[key] = SelfSpecGenerator(
                    model, tokenizer, exit_layer=setting.exit_layer, check_cache=False,
                    draft_vocab=None if setting.draft_vocab is None else list(setting.draft_vocab),
                    exit_adapter=(exit_adapters or {}).get(setting.exit_layer))
        self.max_new_tokens = max_new_tokens
        self.eos = [] if ignore_eos else None
        self.device = next(iter(self.generators.values())).view.device
        # Only silences generate()'s warning for prompts without padding; the model's own when it has one.
        config = getattr(model, "generation_config", None)
        self.pad_token_id = next((t for t in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None))
                                  if isinstance(t, int)), 0)

    def __call__(self, method: str, batch: list[list[int]]):
        """Decode one batch of prompts (token lists) with `method`: (tokens per row, engine stats or None)."""
        if method in ENGINE_METHODS:
            setting = self.settings[method]
            k = 0 if method == "plain" else setting.num_speculations
            drafter = make_policy(ENGINE_METHODS[method], k, setting.ngram)
            out = self.generators[(setting.exit_layer, setting.draft_vocab)].generate(
                batch, max_new_tokens=self.max_new_tokens, drafter=drafter, eos_token_id=self.eos)
            return out.sequences, out.stats
        if len({len(p) for p in batch}) > 1:
            raise ValueError("Hugging Face methods in a batch need prompts of one length; use "
                             "--methods plain,selfspec or --batch-size 1")
        ids = torch.tensor(batch, device=self.device)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=self.max_new_tokens, do_sample=False,
                      pad_token_id=self.pad_token_id)
        if self.eos == []:
            kwargs["eos_token_id"] = None
        if method == "hf_early_exit":  # Hugging Face's self-speculation at the early exit's own E
            kwargs["assistant_early_exit"] = self.settings["selfspec"].exit_layer
        elif method == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        with torch.inference_mode():
            out = self.model.generate(ids, **kwargs)
        return out[:, ids.shape[1]:].tolist(), None


def interleaved_rates(names, run, batches: list[list[list[int]]], repeats: int, warmup: int, device,
                      progress: str | None = None):
    """Time `run(name, batch) -> (tokens per row, stats or None)` for every name on every batch, interleaved.

    `warmup` untimed rounds, then `repeats` timed ones; in each round every batch of prompts is
    decoded by every name, the order of names rotating from round to round so that drift hits all
    alike. `progress`: a tqdm bar's label (None: no bar). Returns ({name: tokens/s of each timed round (all rows' tokens ÷ the summed time)},
    {name: the last round's outputs, one list of rows per batch}, {name: stats of every timed run}).
    """
    names = list(names)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rates = {n: [] for n in names}
    outputs = {n: [None] * len(batches) for n in names}
    stats = {n: [] for n in names}
    bar = tqdm(total=(warmup + repeats) * len(batches), desc=progress, disable=progress is None)
    for round_index in range(warmup + repeats):
        timed = round_index >= warmup
        shift = round_index % len(names)
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for b, batch in enumerate(batches):
            for name in names[shift:] + names[:shift]:
                _sync(device)
                start = time.perf_counter()
                rows, run_stats = run(name, batch)
                _sync(device)
                seconds[name] += time.perf_counter() - start
                tokens[name] += sum(len(row) for row in rows)
                outputs[name][b] = rows
                if timed and run_stats is not None:
                    stats[name].append(run_stats)
            bar.update()
        if timed:
            for name in names:
                rates[name].append(tokens[name] / max(seconds[name], 1e-9))
    bar.close()
    return rates, outputs, stats


def run_benchmark(model, prompts: list[list[int]], exit_layer: int, num_speculations=4, tokenizer=None,
                  max_new_tokens: int = 128, repeats: int = 5, warmup: int = 1, ignore_eos: bool = True,
                  methods: tuple[str, ...] = METHODS, batch_size: int = 1, progress: bool = False,
                  ngram: NGramConfig | None = None, draft_vocab=None,
                  per_method: dict[str, EngineSetting] | None = None, exit_adapters: dict | None = None) -> dict:
    """Measure `methods` on `prompts` (token lists), `batch_size` prompts per call; returns the report
    as a dict (see module docstring). Every engine method decodes at (exit_layer, num_speculations,
    draft_vocab: token ids of a trimmed draft head, ngram: copy settings) unless `per_method` gives
    it a setting of its own (each drafter at its own fastest, as the sweep found them). exit_adapters:
    E -> the checkpoint's `ExitAdapter` for that exit."""
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    batch1_only = [m for m in methods if m in HF_BATCH1_METHODS]
    if batch_size > 1 and batch1_only:
        raise ValueError(f"Hugging Face's assisted generation decodes batch 1 only; leave {', '.join(batch1_only)} "
                         f"out of --methods for --batch-size > 1")
    common = EngineSetting(exit_layer, num_speculations, None if draft_vocab is None else tuple(int(t) for t in draft_vocab),
                           ngram or NGramConfig())
    settings = {m: (per_method or {}).get(m, common) for m in ENGINE_METHODS}
    settings["plain"] = common
    run = _Runner(model, tokenizer, settings, max_new_tokens, ignore_eos, exit_adapters)
    device = run.device
    view = next(iter(run.generators.values())).view
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    rates, outputs, stats = interleaved_rates(methods, run, batches, repeats, warmup, device,
                                              "benchmark" if progress else None)

    report = {"exit_layer": exit_layer, "num_speculations": num_speculations, "max_new_tokens": max_new_tokens,
              "num_prompts": len(prompts), "batch_size": batch_size, "repeats": repeats, "warmup": warmup,
              "device": str(device),
              "dtype": str(view.dtype).replace("torch.", ""), "num_layers": view.num_layers,
              "settings": {m: settings[m].describe() for m in methods if m in ENGINE_METHODS and m != "plain"},
              "methods": {}}
    for method in methods:
        report["methods"][method] = {"tokens_per_second": statistics.median(rates[method]),
                                     "tokens_per_second_all": rates[method]}
    tps = {m: report["methods"][m]["tokens_per_second"] for m in methods}
    report["speedups"] = {f"{a}_over_{b}": tps[a] / tps[b] for a, b in (
        ("hybrid", "hf_prompt_lookup"), ("hybrid", "plain"), ("hybrid", "selfspec"), ("hybrid", "ngram"),
        ("ngram", "hf_prompt_lookup"), ("ngram", "plain"),
        ("selfspec", "plain"), ("selfspec", "hf_early_exit"), ("selfspec", "hf_prompt_lookup"),
        ("plain", "hf_greedy"), ("selfspec", "hf_greedy"), ("hf_early_exit", "hf_greedy"),
        ("hf_prompt_lookup", "hf_greedy")) if a in tps and b in tps}
    reference = "plain" if "plain" in methods else methods[0]
    report["identical_to_" + reference] = {m: outputs[m] == outputs[reference] for m in methods}
    report["greedy_outputs_identical"] = all(report["identical_to_" + reference][m]
                                             for m in methods if m != "hf_early_exit")
    report["sources"] = {m: source_summary(stats[m]) for m in methods if m in ENGINE_METHODS and m != "plain"}
    if "plain" in methods and "selfspec" in methods:
        report["cost_model"] = _cost_model(stats["plain"], stats["selfspec"],
                                           report["speedups"].get("selfspec_over_plain"))
    return report


def source_summary(runs) -> dict:
    """Where the drafts of engine runs came from: per source (copy, early exit) the rounds, drafted,
    accepted and α, and the share of all generated tokens that were accepted drafts of that source."""
    generated = sum(s.generated_tokens for s in runs)
    out = {}
    for source in ("copy", "early_exit"):
        pooled = AcceptanceStats()
        for stats in runs:
            pooled.merge(getattr(stats, source))
        out[source] = {"rounds": pooled.rounds, "drafted": pooled.drafted, "accepted": pooled.accepted,
                       "acceptance_rate": pooled.acceptance_rate,
                       "share_of_tokens": pooled.accepted / generated if generated else float("nan")}
    return out


def pooled_costs(plain_runs, spec_runs) -> dict:
    """Engine runs pooled: acceptance statistics of `spec_runs`, seconds per plain step (from
    `plain_runs`), per draft step and per verification, and the draft cost c = draft ÷ plain step."""
    pooled = AcceptanceStats()
    draft_time = verify_time = 0.0
    draft_steps = spec_rounds = 0
    for stats in spec_runs:
        pooled.merge(stats)
        draft_time += stats.draft_time
        verify_time += stats.verify_time
        draft_steps += stats.draft_steps
        spec_rounds += stats.rounds - stats.plain_steps
    plain_step = sum(s.plain_time for s in plain_runs) / max(1, sum(s.plain_steps for s in plain_runs))
    draft_step = draft_time / draft_steps if draft_steps else float("nan")
    return {"stats": pooled, "plain_step": plain_step, "draft_step": draft_step, "draft_steps": draft_steps,
            "spec_rounds": spec_rounds, "verify_per_round": verify_time / max(1, spec_rounds),
            "draft_cost": draft_step / plain_step if plain_step else float("nan")}


def _cost_model(plain_runs, spec_runs, measured: float | None) -> dict:
    """α, mean accepted length, c and the predictions, pooled over the timed selfspec runs."""
    costs = pooled_costs(plain_runs, spec_runs)
    pooled, plain_step, draft_steps = costs["stats"], costs["plain_step"], costs["draft_steps"]
    alpha = pooled.acceptance_rate
    out = {"acceptance_rate": alpha, "draft_efficiency": pooled.draft_efficiency,
           "mean_accepted_length": pooled.mean_accepted_length, "mean_accepted_length_counts_bonus": True,
           "per_position_acceptance": pooled.per_position_acceptance,
           "accepted_histogram": pooled.accepted_histogram,
           "k_rounds": {int(k): n for k, n in sorted(pooled.k_rounds.items())},
           "plain_step_seconds": plain_step}
    if not draft_steps or alpha != alpha:  # no speculative round (auto may turn it off): nothing to predict
        return out
    draft_step, c, verify = costs["draft_step"], costs["draft_cost"], costs["verify_per_round"]
    k_mean = draft_steps / costs["spec_rounds"]
    k_rounds = pooled.k_rounds
    out.update({
        "draft_step_seconds": draft_step, "verify_seconds_per_round": verify,
        "draft_cost": c, "mean_k": k_mean,
        # E(k)/(1 + k·c) per round, weighted by how many rounds used each k (k = 0 rounds count 1/1)
        "predicted_speedup": predicted_speedup(k_rounds, alpha, c),
        "predicted_speedup_kv_reuse": speedup_kv_reuse(round(k_mean), alpha, c),
        "predicted_speedup_measured_costs": speedup_measured_costs(
            round(k_mean), alpha, draft_step, verify, plain_step),
    })
    if measured is not None:
        out["measured_over_predicted"] = measured / out["predicted_speedup"]
    return out


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write `benchmark.json` and `benchmark.md` into out_dir (atomically); returns their paths."""
    json_path, md_path = write_files(out_dir, "benchmark", report, to_markdown(report))
    return json_path, md_path


def _describe_setting(method: str, settings: dict) -> str:
    setting = settings.get("selfspec" if method == "hf_early_exit" else method)
    if method == "hf_prompt_lookup":
        return f"prompt_lookup_num_tokens = {PROMPT_LOOKUP_TOKENS}"
    if setting is None:
        return ""
    ngram = f"min_ngram = {setting['ngram']['min_ngram']}, max_copy = {setting['ngram']['max_copy']}"
    if method == "ngram":
        return ngram
    text = f"E = {setting['exit_layer']}" + ("" if method == "hf_early_exit" else f", k = {setting['num_speculations']}")
    if setting["draft_vocab_size"] and method != "hf_early_exit":
        text += f", V' = {setting['draft_vocab_size']}"
    return text + (f", {ngram}" if method == "hybrid" else "")


def to_markdown(report: dict) -> str:
    lines = [f"# Self-speculative decoding benchmark ({report['num_layers']} layers)", "",
             f"{report['num_prompts']} prompts, batch {report.get('batch_size', 1)}, {report['max_new_tokens']} "
             "new tokens, greedy, "
             f"{report['device']} {report['dtype']}, median of {report['repeats']} interleaved repeats "
             f"after {report['warmup']} warm-up.", "",
             "| method | tokens/s | setting |", "|---|---:|---|"]
    settings = report.get("settings", {})
    for method, row in report["methods"].items():
        lines.append(f"| {method} | {row['tokens_per_second']:.1f} | {_describe_setting(method, settings)} |")
    lines += ["", "| speedup | × |", "|---|---:|"]
    lines += [f"| {name.replace('_over_', ' / ')} | {value:.3f} |" for name, value in report["speedups"].items()]
    sources = report.get("sources", {})
    if sources:
        lines += ["", "| method | source | rounds | drafted | accepted | α | share of tokens |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {method} | {source} | {row['rounds']} | {row['drafted']} | {row['accepted']} | "
                  f"{row['acceptance_rate']:.3f} | {row['share_of_tokens']:.1%} |"
                  for method, per_source in sources.items() for source, row in per_source.items() if row["rounds"]]
    cost = report.get("cost_model", {})
    if cost:
        lines += ["", "| cost model | value |", "|---|---:|"]
        for name, value in cost.items():
            if isinstance(value, float):
                shown = f"{value:.4g}"
            elif isinstance(value, list):
                shown = ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in value)
            else:
                shown = str(value)
            lines.append(f"| {name} | {shown} |")
    lines += ["", "Greedy outputs identical (every method but hf_early_exit, which is reported apart): "
              f"**{report['greedy_outputs_identical']}**; identical to plain per method: "
              + ", ".join(f"{m} {same}" for m, same in report.get("identical_to_plain", {}).items())]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

def read_prompts(args, tokenizer) -> list[list[int]]:
    """--prompts file when given, else the first tokens of --corpus's test documents."""
    if args.prompts is None:
        return prompts_from_corpus(tokenizer, args.corpus, args.num_prompts, args.prompt_tokens)
    if args.prompts.endswith(".json"):
        items = json.loads(Path(args.prompts).read_text())
    else:
        items = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [tokenizer(item)["input_ids"] if isinstance(item, str) else [int(t) for t in item] for item in items]
    return prompts[:args.num_prompts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The speed benchmark's flags (`selfspec eval speedup`, `eval/benchmark_speedup.py`)."""
    parser.add_argument("--model", required=True, help="directory loadable with AutoModelForCausalLM")
    parser.add_argument("--exit-layer", type=int, default=None,
                        help="E: blocks the draft runs (default: the checkpoint's selfspec.json)")
    parser.add_argument("--num-speculations", default=None,
                        help="k (int), 'auto' or 'window' (default: selfspec.json's, else auto)")
    parser.add_argument("--prompts", default=None, help="JSON list (token lists or strings) or text file")
    parser.add_argument("--corpus", default="stdlib", help="without --prompts: prompts from this corpus's test split")
    parser.add_argument("--num-prompts", type=int, default=8, help="use the first N prompts")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length taken from corpus documents")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="V' of the early exit's head (0: all; default: selfspec.json's)")
    parser.add_argument("--min-ngram", type=int, default=None,
                        help="shortest context match that copies (default: selfspec.json's, else 2)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts per generate call (hf_early_exit and hf_prompt_lookup run batch 1 only)")
    parser.add_argument("--keep-eos", action="store_true", help="stop at eos (default: always max-new-tokens)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--out", default="runs/benchmark")


def engine_settings(args, meta: dict, exit_layer: int) -> tuple[EngineSetting, dict[str, EngineSetting]]:
    """The settings the engine methods decode with: the flags, else the checkpoint's selfspec.json.

    Without flags that set E, k, V' or min_ngram, each drafter whose fastest setting a sweep stored
    (`selfspec.json` "fastest") runs at that setting: the early exit alone at its best, the copy
    drafters at theirs.
    """
    k = args.num_speculations or meta.get("num_speculations", "auto")
    k = k if k in ("auto", "window") else int(k)
    ngram = NGramConfig.from_dict(meta.get("ngram"))
    if args.min_ngram is not None:
        ngram = NGramConfig(max(ngram.max_ngram, args.min_ngram), args.min_ngram, ngram.max_copy)
    size = meta.get("draft_vocab_size") if args.draft_vocab_size is None else args.draft_vocab_size

    def vocab(size):
        return None if not size else tuple(int(t) for t in checkpoint_draft_vocab(args.model, size))

    common = EngineSetting(exit_layer, k, vocab(size), ngram)
    flags = (args.exit_layer, args.num_speculations, args.draft_vocab_size, args.min_ngram)
    per_method = {}
    if all(flag is None for flag in flags):
        for drafter, best in meta.get("fastest", {}).items():
            method = "selfspec" if drafter == "early_exit" else drafter
            per_method[method] = EngineSetting(
                best.get("exit_layer") or exit_layer, best.get("num_speculations") or k, vocab(best.get("vocab")),
                NGramConfig(max(ngram.max_ngram, best["min_ngram"]), best["min_ngram"], ngram.max_copy)
                if best.get("min_ngram") else ngram)
    return common, per_method


def checkpoint_adapters(model_dir: str, model, meta: dict) -> dict:
    """{E: ExitAdapter} for the exit adapter a checkpoint holds (empty without one)."""
    layer = (meta.get("exit_adapter") or {}).get("exit_layer")
    return {} if layer is None else {layer: exit_adapter_for(model_dir, layer, model)}


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark that `args` (from `add_arguments`) describes; prints and writes the report."""
    meta = read_meta(args.model) if (Path(args.model) / META_FILE).is_file() else {}
    exit_layer = args.exit_layer or meta.get("exit_layer")
    if exit_layer is None:
        raise ValueError(f"--exit-layer is required: {args.model} has no {META_FILE}")
    common, per_method = engine_settings(args, meta, exit_layer)
    model, tokenizer = load_model(args.model, args.device, args.dtype)
    prompts = read_prompts(args, tokenizer)
    report = run_benchmark(model, prompts, common.exit_layer, common.num_speculations, tokenizer=tokenizer,
                           max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=args.warmup,
                           ignore_eos=not args.keep_eos, methods=tuple(args.methods.split(",")),
                           batch_size=args.batch_size, progress=True, ngram=common.ngram,
                           draft_vocab=common.draft_vocab, per_method=per_method,
                           exit_adapters=checkpoint_adapters(args.model, model, meta))
    report["model"] = args.model
    json_path, md_path = write_report(report, args.out)
    print(to_markdown(report))
    print(f"wrote {json_path} and {md_path}")
    return report


def main(argv=None) -> dict:
    """`python eval/benchmark_speedup.py ...`: the same flags as `selfspec eval speedup`."""
    parser = argparse.ArgumentParser(prog="selfspec eval speedup", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
