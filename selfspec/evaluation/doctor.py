"""`selfspec doctor`: why a model does or does not decode faster, from a short probe.

The probe decodes a few prompts with plain decoding, the early exit, copies and the hybrid
(`timing.make_runner` and `timing.interleaved_rates`, the round profile on; `costs.cost_model` reads
α, c and v from the runs), and times the passes at a short and a long context
(`timing.measure_passes`). The diagnosis (`diagnosis.diagnose`) goes through the practitioners'
checklist in order, each check one line from the measured figures: acceptance, draft cost,
per-round overhead, context, prefill (from a benchmark's figures; this short probe leaves it out)
and the verdict.

    selfspec doctor runs/smollm2/base --exit-layer 10
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..checkpoint import checkpoint_adapters, resolve_settings
from ..errors import UserError
from ..files import write_json_atomic
from ..model import DecoderView
from .costs import cost_model, weight_cost, weights_in_cache
from .diagnosis import diagnose
from .paired import median_interval, paired_speedups
from .prompts import read_prompts, suite_prompts
from .results import DoctorResult
from .rounds import round_profile
from .timing import interleaved_rates, load_model, make_runner, measure_passes

PROBE = ("plain", "early_exit", "ngram", "hybrid")  # the methods the probe decodes with


def doctor(model: str, *, exit_layer: int | None = None, num_speculations: int | None = None,
           prompts: str | None = None, corpus: str = "stdlib", suites: str | None = None,
           questions: str | None = None, num_prompts: int = 2, max_new_tokens: int = 32,
           context: int = 256, long_context: int = 2048, repeats: int = 1, device: str | None = None,
           dtype: str = "auto", out: str | None = None) -> DoctorResult:
    """Probe the model `model` and print the diagnosis; returns {"figures", "diagnosis"} (also written
    as doctor.json into `out` when given). E and k default to the checkpoint's (k = 3 when it has
    none or an adaptive one)."""
    if num_prompts < 1 or max_new_tokens < 1 or repeats < 1 or not 1 <= context < long_context:
        raise UserError(f"--num-prompts ({num_prompts}), --max-new-tokens ({max_new_tokens}) and --repeats "
                        f"({repeats}) must be >= 1, and 1 <= --context ({context}) < --long-context "
                        f"({long_context})")
    settings, _, counts = resolve_settings(model, exit_layer=exit_layer, num_speculations=num_speculations)
    if settings.exit_layer is None:
        raise UserError(f"--exit-layer is required: {model} has no selfspec.json")
    k = settings.num_speculations
    k = k if isinstance(k, int) and k else 3  # an adaptive or plain checkpoint: probe k = 3
    settings = settings.override(drafter="early_exit", num_speculations=k)
    lm, tokenizer = load_model(model, device, dtype)
    view = DecoderView(lm)
    if not 1 <= settings.exit_layer < view.num_layers:
        raise UserError(f"--exit-layer {settings.exit_layer} is not in 1..{view.num_layers - 1}")
    if suites or questions:  # chat questions through the model's chat template, one per category first
        chosen = suite_prompts(tokenizer, suites, questions, 1)[:num_prompts]
    else:
        chosen = read_prompts(tokenizer, prompts, corpus, num_prompts)
    run = make_runner(lm, settings, tokenizer=tokenizer, token_counts=counts,
                      exit_adapters=checkpoint_adapters(model, lm), max_new_tokens=max_new_tokens,
                      profile=True)
    timings = interleaved_rates(PROBE, run, [[p] for p in chosen], repeats, 1, run.device)
    rates, runs = {m: timings.rates(m) for m in PROBE}, {m: timings.run_stats(m) for m in PROBE}
    cost = cost_model(runs["plain"], runs["early_exit"], None)
    if "draft_cost" not in cost:
        raise UserError("the probe drafted nothing with the early exit (η stopped every round?); "
                        "pass --num-speculations or lower the checkpoint's stop_below")
    passes = {length: measure_passes(view, settings.exit_layer, length, (k + 1,), repeats=5, warmup=1)
              for length in (context, long_context)
              if view.max_positions is None or length + k + 1 <= view.max_positions}

    def ratio(length, name):
        return passes[length][name]["seconds"] / passes[length]["plain"]["seconds"]

    both = long_context in passes and context in passes
    growth = {name: ratio(long_context, key) / ratio(context, key) if both else None
              for name, key in (("draft", "draft"), ("verify", f"verify_{k + 1}"))}
    figures = {
        "exit_layer": settings.exit_layer, "num_layers": view.num_layers, "k": k,
        "alpha": cost["acceptance_rate"], "draft_cost": cost["draft_cost"],
        "verify_cost": cost["verify_cost"], "drafted_ahead": cost.get("drafted_ahead_share"),
        "weight_cost": weight_cost(view, settings.exit_layer, settings.draft_vocab_size or 0),
        "weights_in_cache": weights_in_cache(view),
        "overhead": round_profile(runs)["methods"]["early_exit"]["plain_steps"]["outside_passes"],
        "context": context, "long_context": long_context,
        # the engine's c and v at the short context, scaled by how the bare passes grow with context
        "draft_cost_long": None if growth["draft"] is None else cost["draft_cost"] * growth["draft"],
        "verify_cost_long": None if growth["verify"] is None else cost["verify_cost"] * growth["verify"],
        "speedups": {m: median_interval(paired_speedups(rates[m], rates["plain"]))["speedup"] for m in PROBE
                     if m != "plain"},
        "tokens_per_second": {m: statistics.median(rates[m]) for m in PROBE},
        "settings": settings.to_json(),
    }
    lines = diagnose(figures)
    print(f"selfspec doctor: {model} (E = {settings.exit_layer} of {view.num_layers}, k = {k}; "
          f"{len(chosen)} prompts x {max_new_tokens} tokens)")
    print("\n".join(lines))
    result = {"figures": figures, "diagnosis": lines}
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(out) / "doctor.json", result)
    return result


__all__ = ["PROBE", "doctor"]
