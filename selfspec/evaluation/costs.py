"""The cost model's figures from engine runs: what the benchmark, the sweep and the suite report
beside their speedups, and what the diagnosis reads.

- `pooled_costs`: runs pooled: their acceptance statistics, seconds per plain step, per draft step
  and per verification, and the draft cost c = draft step ÷ plain step;
- `cost_model`: α, the mean accepted length, c and v (in plain steps) and the cost model's
  predictions (`selfspec.metrics`) over the timed early-exit runs;
- `weight_cost`: c as the weights predict it (E/N plus the head); `weights_in_cache`: whether the
  weights fit in the CPU's last-level cache;
- `source_summary` (where the drafts came from: copies, a grammar's forced tokens, the early exit),
  `prefill_split` (the prefill's share of each method's time) and `grammar_costs` (llguidance's masks
  per token).

A leaf of `evaluation/`: it imports no other module of it.
"""

from __future__ import annotations

from ..cpu import last_level_cache_bytes
from ..decoding.outputs import SOURCES
from ..metrics import (
    AcceptanceStats,
    break_even_acceptance,
    predicted_speedup,
    speedup_kv_reuse,
    speedup_measured_costs,
    weight_draft_cost,
)


def source_summary(runs) -> dict:
    """Where the drafts of engine runs came from: per source (copy, forced by a grammar, early exit)
    the rounds, drafted, accepted and α, and the share of all generated tokens that were accepted
    drafts of that source."""
    generated = sum(s.generated_tokens for s in runs)
    out = {}
    for source in SOURCES:
        pooled = AcceptanceStats()
        for stats in runs:
            pooled.merge(getattr(stats, source))
        out[source] = {"rounds": pooled.rounds, "drafted": pooled.drafted, "accepted": pooled.accepted,
                       "acceptance_rate": pooled.acceptance_rate,
                       "share_of_tokens": pooled.accepted / generated if generated else float("nan")}
    return out


def prefill_split(runs_by_method: dict) -> dict:
    """Each engine method's time split at its first round: the prefill (and the call's setup), the
    same work for every method, and the decoding after it, where the drafters differ. Per method:
    `share` (the prefill's share of its time), `decode_tokens_per_second` (tokens ÷ the time after the
    prefill) and `decode_over_plain` (that rate ÷ plain's). A drafter's speedup end to end is its
    decoding's diluted by the prefill: with a share p of plain's time, a decoding s× faster gives
    1 / (p + (1 − p) / s)."""
    split = {}
    for method, runs in runs_by_method.items():
        prefill, total = sum(s.prefill_time for s in runs), sum(s.total_time for s in runs)
        tokens = sum(s.generated_tokens for s in runs)
        if total > prefill > 0:
            split[method] = {"share": prefill / total, "decode_tokens_per_second": tokens / (total - prefill)}
    plain = split.get("plain")
    for row in split.values():
        row["decode_over_plain"] = (row["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
                                    if plain else float("nan"))
    return split


def grammar_costs(plain_runs) -> dict:
    """What the grammar costs in constrained plain decoding: llguidance's seconds per generated token,
    and as a share of a plain step."""
    tokens = sum(s.generated_tokens for s in plain_runs)
    per_token = sum(s.grammar_time for s in plain_runs) / max(1, tokens)
    plain_step = sum(s.plain_time for s in plain_runs) / max(1, sum(s.plain_steps for s in plain_runs))
    return {"seconds_per_token": per_token, "share_of_plain_step": per_token / plain_step if plain_step
            else float("nan")}


def pooled_costs(plain_runs, spec_runs) -> dict:
    """Engine runs pooled: acceptance statistics of `spec_runs`, seconds per plain step (from
    `plain_runs`), per draft step and per verification, and the draft cost c = draft ÷ plain step."""
    pooled = AcceptanceStats()
    draft_time = verify_time = 0.0
    draft_steps = spec_rounds = ahead = 0
    for stats in spec_runs:
        pooled.merge(stats)
        draft_time += stats.draft_time
        verify_time += stats.verify_time
        draft_steps += stats.draft_steps
        spec_rounds += stats.rounds - stats.plain_steps
        ahead += stats.drafted_ahead
    plain_step = sum(s.plain_time for s in plain_runs) / max(1, sum(s.plain_steps for s in plain_runs))
    draft_step = draft_time / draft_steps if draft_steps else float("nan")
    return {"stats": pooled, "plain_step": plain_step, "draft_step": draft_step, "draft_steps": draft_steps,
            "spec_rounds": spec_rounds, "verify_per_round": verify_time / max(1, spec_rounds),
            "drafted_ahead_share": ahead / max(1, spec_rounds),
            "draft_cost": draft_step / plain_step if plain_step else float("nan")}


def cost_model(plain_runs, spec_runs, measured: float | None, weights: float | None = None,
               in_cache: list[int] | None = None) -> dict:
    """α, mean accepted length, c and the predictions, pooled over the timed early_exit runs;
    `weights`: the c its weights predict (`weight_cost`), kept beside the measured one;
    `in_cache`: [weight bytes, cache bytes] where the weights fit in the CPU's last-level cache
    (`weights_in_cache`), which the diagnosis names. "drafted_ahead_share": the share of rounds
    whose drafts ran beside the round before's verification (`DecodeSettings.overlap`); c and v then
    measure what a round pays, not a pass alone."""
    costs = pooled_costs(plain_runs, spec_runs)
    pooled, plain_step, draft_steps = costs["stats"], costs["plain_step"], costs["draft_steps"]
    alpha = pooled.acceptance_rate
    out = {"acceptance_rate": alpha, "draft_efficiency": pooled.draft_efficiency,
           "mean_accepted_length": pooled.mean_accepted_length, "mean_accepted_length_counts_bonus": True,
           "per_position_acceptance": pooled.per_position_acceptance,
           "accepted_histogram": pooled.accepted_histogram,
           "k_rounds": {int(k): n for k, n in sorted(pooled.k_rounds.items())},
           "plain_step_seconds": plain_step}
    if weights is not None:
        out["weight_cost"] = weights
    if in_cache is not None:
        out["weights_in_cache"] = in_cache
    if not draft_steps or alpha != alpha:  # no speculative round (auto may turn it off): nothing to predict
        return out
    draft_step, c, verify = costs["draft_step"], costs["draft_cost"], costs["verify_per_round"]
    k_mean = draft_steps / costs["spec_rounds"]
    k_rounds = pooled.k_rounds
    out.update({
        "draft_step_seconds": draft_step, "verify_seconds_per_round": verify,
        "draft_cost": c, "mean_k": k_mean, "drafted_ahead_share": costs["drafted_ahead_share"],
        "verify_cost": verify / plain_step,
        # E(k)/(k·c + v) per round with v the measured verification in plain steps, weighted by how
        # many rounds used each k (k = 0 rounds count 1/1)
        "predicted_speedup": predicted_speedup(k_rounds, alpha, c, verify / plain_step),
        "predicted_speedup_kv_reuse": speedup_kv_reuse(round(k_mean), alpha, c),
        "predicted_speedup_measured_costs": speedup_measured_costs(
            round(k_mean), alpha, draft_step, verify, plain_step),
        # the α these rounds would need to match plain decoding at the measured c and v
        "break_even_acceptance": break_even_acceptance(k_rounds, c, verify / plain_step),
    })
    if measured is not None:
        out["measured_over_predicted"] = measured / out["predicted_speedup"]
    return out


def weights_in_cache(view) -> list[int] | None:
    """[the model's weight bytes, the CPU's last-level cache bytes] where the weights fit in that cache
    (a model decoding on CPU), else None. Such a model's passes do not stream their weights from
    memory: they are bound by compute and per-step work, which the weights' c does not count."""
    if view.device.type != "cpu":
        return None
    cache = last_level_cache_bytes()
    weights = sum(p.numel() * p.element_size() for p in view.model.parameters())
    return [weights, cache] if cache and weights <= cache else None


def weight_cost(view, exit_layer: int, draft_vocab_size: int = 0) -> float:
    """c as the weights predict it for E = `exit_layer` and a draft head of V' rows (0: the whole head)."""
    blocks = [sum(p.numel() for p in layer.parameters()) for layer in view.layers]
    head = view.lm_head.weight
    draft_head = draft_vocab_size * head.shape[1] if draft_vocab_size else None
    return weight_draft_cost(exit_layer, blocks, head.numel(), draft_head)


__all__ = ["cost_model", "grammar_costs", "pooled_costs", "prefill_split", "source_summary", "weight_cost",
           "weights_in_cache"]
