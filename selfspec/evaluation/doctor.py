"""`selfspec doctor`: why a model does or does not decode faster, from a short probe.

The probe decodes a few prompts with plain decoding, the early exit, copies and the hybrid
(`timing.make_runner` and `timing.interleaved_rates`, the round profile on; `costs.cost_model` reads
α, c and v from the runs), and measures a round's costs through the engine at a short and a long
context (`context_costs.measure_round_costs`, printed as a table by length). The diagnosis
(`diagnosis.diagnose`) goes through the practitioners' checklist in order, each check one line from
the measured figures: acceptance, draft cost, per-round overhead, context, prefill (from a
benchmark's figures; this short probe leaves it out) and the verdict.

    selfspec doctor runs/smollm2/base --exit-layer 10

On an exported draft (`selfspec export MODEL --draft DIR`: a directory with export.json) it says what a
separate-draft engine (llama.cpp's --model-draft, Hugging Face's assistant_model, vLLM's draft_model)
should get from it (`draft_probe`): α measured by the draft itself against its target's greedy replies,
and from it and the draft's cost in weights read the best k and the speedup bound.

    selfspec doctor runs/demo/export --num-prompts 8 --max-new-tokens 128
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from ..checkpoint import resolve_settings
from ..decoding import DecodeSettings, SelfSpecGenerator
from ..errors import UserError
from ..export import EXPORT_FILE
from ..files import write_json_atomic
from ..metrics import optimal_num_speculations, speedup_simple
from ..model import DecoderView
from ..model.loading import load_causal_lm
from .context_costs import ROOM, costs_table, measure_round_costs
from .costs import cost_model, weight_cost, weights_in_cache
from .diagnosis import diagnose
from .options import DoctorOptions
from .paired import median_interval, paired_speedups
from .prompts import read_prompts, suite_prompts
from .results import DoctorResult
from .rounds import round_profile
from .timing import interleaved_rates, load_checkpoint, make_runner

PROBE = ("plain", "early_exit", "ngram", "hybrid")  # the methods the probe decodes with


def doctor(options: DoctorOptions) -> DoctorResult:
    """Probe the model `options.model` and print the diagnosis; returns {"figures", "diagnosis"} (also
    written as doctor.json into `options.out` when given). E and k default to the checkpoint's (k = 3
    when it has none or an adaptive one)."""
    model = options.model
    if (Path(model) / EXPORT_FILE).is_file():
        return _report(options, draft_probe(options))
    settings, _, counts = resolve_settings(model, exit_layer=options.exit_layer,
                                           num_speculations=options.num_speculations)
    if settings.exit_layer is None:
        raise UserError(f"--exit-layer is required: {model} has no selfspec.json")
    k = settings.num_speculations
    k = k if isinstance(k, int) and k else 3  # an adaptive or plain checkpoint: probe k = 3
    settings = settings.override(drafter="early_exit", num_speculations=k)
    checkpoint = load_checkpoint(model, settings, None, counts, device=options.device, dtype=options.dtype)
    view = DecoderView(checkpoint.model)
    if not 1 <= settings.exit_layer < view.num_layers:
        raise UserError(f"--exit-layer {settings.exit_layer} is not in 1..{view.num_layers - 1}")
    tokenizer = checkpoint.tokenizer
    if options.suites or options.questions:  # chat questions through the chat template, one per category
        chosen = suite_prompts(tokenizer, options.suites, options.questions, 1)[:options.num_prompts]
    else:
        chosen = read_prompts(tokenizer, options.prompts, options.corpus, options.num_prompts)
    run = make_runner(checkpoint, max_new_tokens=options.max_new_tokens, profile=True,
                      sampling=options.sampling_keywords(seed=0))
    timings = interleaved_rates(PROBE, run, [[p] for p in chosen], options.repeats, 1, run.device)
    figures = _figures(options, view, settings, timings)
    figures.update(_by_context(options, checkpoint, settings, [t for p in chosen for t in p]))
    lines = diagnose(figures)
    print(f"selfspec doctor: {model} (E = {settings.exit_layer} of {view.num_layers}, k = {k}; "
          f"{len(chosen)} prompts x {options.max_new_tokens} tokens, {options.sampling().describe()})")
    if figures["round_costs"]:
        table = costs_table(figures["round_costs"], k)
        print(f"a round's costs by context length (greedy, k = {k}):\n{table}")
    return _report(options, {"figures": figures, "diagnosis": lines})


def _report(options: DoctorOptions, result: DoctorResult) -> DoctorResult:
    """Print the diagnosis and write doctor.json into `options.out` when given."""
    print("\n".join(result["diagnosis"]))
    if options.out:
        Path(options.out).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(options.out) / "doctor.json", result)
    return result


def draft_probe(options: DoctorOptions) -> DoctorResult:
    """What a separate-draft engine should get from the exported draft `options.model`: its target (the
    export's source) decodes the prompts greedily (plain, under each prompt's grammar), the draft reads
    prompt and reply in one pass, and α is how often its top token is the target's next one (the
    acceptance of greedy verification, unmasked: under a grammar a lower bound). With the draft's cost c
    in weights read (`export.separate_draft_estimate`): the best k and E(k, α) / (1 + k·c), an upper
    bound (each engine's per-round overhead left out)."""
    export = Path(options.model)
    meta = json.loads((export / EXPORT_FILE).read_text())
    target = Path(meta["source"])
    if not target.is_dir():
        raise UserError(f"{export} was exported from {target}, which is not there; run selfspec doctor from "
                        f"the directory the export ran in")
    plain = DecodeSettings(exit_layer=meta["exit_layer"], num_speculations=0)
    checkpoint = load_checkpoint(str(target), plain, device=options.device, dtype=options.dtype)
    view = DecoderView(checkpoint.model)
    dtype = str(view.dtype).removeprefix("torch.")
    draft = load_causal_lm(str(export), dtype=dtype, device=view.device).eval()
    chosen = read_prompts(checkpoint.tokenizer, options.prompts, options.corpus, options.num_prompts)
    run = make_runner(checkpoint, max_new_tokens=options.max_new_tokens)
    agreed = scored = 0
    for prompt in chosen:
        (reply,), _ = run("plain", [prompt])
        ids = list(getattr(prompt, "ids", prompt))
        with torch.inference_mode():
            logits = draft(torch.tensor([ids + reply], device=view.device)).logits[0]
        guesses = logits[len(ids) - 1:len(ids) + len(reply) - 1].argmax(-1).tolist()
        agreed += sum(g == t for g, t in zip(guesses, reply))
        scored += len(reply)
    alpha, cost = agreed / max(1, scored), meta["separate_draft"]["draft_cost"]
    k, speedup = optimal_num_speculations(alpha, cost, 8, speedup_simple)
    stored = meta["separate_draft"]["acceptance"]
    figures = {"exit_layer": meta["exit_layer"], "exit_blocks": meta["exit_blocks"],
               "num_layers": meta["num_layers"], "alpha": alpha, "alpha_held_out": stored, "draft_cost": cost,
               "num_speculations": k, "predicted_speedup": speedup, "tokens": scored}
    held_out = f" (the checkpoint's held-out: {stored:.2f})" if stored is not None else ""
    lines = [f"selfspec doctor: {export}, a draft of {meta['exit_layer']} + {meta['exit_blocks']} blocks for "
             f"{target}'s {meta['num_layers']} ({len(chosen)} prompts x {options.max_new_tokens} tokens)",
             f"- acceptance: α = {alpha:.3f} over {scored} of the target's greedy tokens{held_out}",
             f"- draft cost: c = {cost:.2f} of a target step (its own KV cache: no reuse of the target's)",
             f"- verdict: up to {speedup:.2f}x at k = {k} in a separate-draft engine" if k else
             f"- verdict: no k beats plain decoding at α = {alpha:.2f} and c = {cost:.2f}"]
    return {"figures": figures, "diagnosis": lines}


def _figures(options: DoctorOptions, view: DecoderView, settings, timings) -> dict:
    """The diagnosis's figures from the probe's `timings` (the costs by context length: `_by_context`)."""
    k, context, long_context = settings.num_speculations, options.context, options.long_context
    rates, runs = {m: timings.rates(m) for m in PROBE}, {m: timings.run_stats(m) for m in PROBE}
    cost = cost_model(runs["plain"], runs["early_exit"], None)
    if "draft_cost" not in cost:
        raise UserError("the probe drafted nothing with the early exit (η stopped every round?); "
                        "pass --num-speculations or lower the checkpoint's stop_below")
    return {
        "exit_layer": settings.exit_layer, "num_layers": view.num_layers, "k": k,
        "alpha": cost["acceptance_rate"], "draft_cost": cost["draft_cost"],
        "verify_cost": cost["verify_cost"], "drafted_ahead": cost.get("drafted_ahead_share"),
        "weight_cost": weight_cost(view, settings.exit_layer, settings.draft_vocab_size or 0),
        "weights_in_cache": weights_in_cache(view),
        "overhead": round_profile(runs)["methods"]["early_exit"]["plain_steps"]["outside_passes"],
        "context": context, "long_context": long_context,
        "speedups": {m: median_interval(paired_speedups(rates[m], rates["plain"]))["speedup"] for m in PROBE
                     if m != "plain"},
        "tokens_per_second": {m: statistics.median(rates[m]) for m in PROBE},
        "settings": settings.to_json(),
    }


def _by_context(options: DoctorOptions, checkpoint, settings, tokens: list[int]) -> dict:
    """The round's costs through the engine at the short and the long context (the prompts' tokens
    repeated to each length, `context_costs.measure_round_costs`): the table's rows (`round_costs`), and
    c and v at both, which check 4 compares (None at a length past the model's positions)."""
    limit = DecoderView(checkpoint.model).max_positions
    lengths = tuple(n for n in (options.context, options.long_context) if limit is None or n + ROOM <= limit)
    generator = SelfSpecGenerator(checkpoint.model, checkpoint.tokenizer, settings=settings,
                                  token_counts=checkpoint.token_counts,
                                  exit_adapters=checkpoint.exit_adapters)
    _, rows = measure_round_costs(generator, tokens, settings, lengths, repeats=options.repeats + 1,
                                  progress=False) if lengths else (None, [])
    at = {row["length"]: row for row in rows}
    k = settings.num_speculations

    def costs(length):
        row = at.get(length)
        return (None, None) if row is None else (row["c"], 1 + k * row["s"])

    (c, v), (c_long, v_long) = costs(options.context), costs(options.long_context)
    return {"draft_cost_short": c, "verify_cost_short": v, "draft_cost_long": c_long,
            "verify_cost_long": v_long, "round_costs": rows}


__all__ = ["PROBE", "doctor", "draft_probe"]
