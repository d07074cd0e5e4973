"""The practitioners' checklist: why a model does or does not decode faster, from measured figures.

`diagnose` goes through the checks in order, each one line from the figures:

1. acceptance: the early exit's α against the α its measured costs need (`break_even_acceptance`);
2. draft cost: c measured against the share of the weights a draft step reads (E/N plus the head);
3. per-round overhead: the work between a round's passes, in plain steps;
4. context: how c and v grow from the short to the long context;
5. prefill: the prompts' share of plain decoding's time, which every method pays alike (from a
   benchmark's figures; the doctor's own short probe leaves it out);
6. verdict: the fastest drafter measured, and what would change it.

A check whose figures are absent is left out, so a benchmark, a sweep or a suite gives the checks it
measured: `cost_figures` reads them from a report's cost model (`costs.cost_model`), and `summary`
joins the lines into the one paragraph that `eval speedup`, `sweep` and `suite` end with.
`selfspec doctor` (`doctor.py`) measures every figure and prints the lines.

A leaf of `evaluation/`: it imports no other module of it.
"""

from __future__ import annotations

from ..metrics import break_even_acceptance

# A check flags its figure beyond these (the first two in plain steps' ratios)
DRAFT_COST_MARGIN = 1.25  # measured c over the weights' share
OVERHEAD_LIMIT = 0.10  # work between the passes, per round, in plain steps
CONTEXT_GROWTH = 1.15  # c or v at the long context over the short
PREFILL_SHARE = 0.20  # the prefill's share of plain decoding's time worth a line


def diagnose(figures: dict) -> list[str]:
    """The checklist's lines from the probe's figures: `alpha`, `k`, `exit_layer`, `draft_cost` (c),
    `verify_cost` (v), `weight_cost` (the weights' c), `overhead` (plain steps per round outside the
    passes), `context`, `long_context`, `draft_cost_long`, `verify_cost_long` (the last two None when
    the long context was not measured), `speedups` (method -> × plain); optionally `k_rounds` (k ->
    rounds, for a run whose k varied), `drafted_ahead` (the share of rounds whose drafts ran beside the
    round before's verification: overlapped rounds) and `prefill` ({"share": the prefill's share of
    plain's time, "decode": the fastest method's decoding × plain after it}). A check whose figures are
    absent is left out, so a benchmark, a sweep or a suite gives the checks it measured (`summary`)."""
    lines = []
    if figures.get("draft_cost") is not None:
        lines.append(_acceptance(figures))
    if figures.get("draft_cost") is not None and figures.get("weight_cost") is not None:
        lines.append(_draft_cost(figures["draft_cost"], figures["weight_cost"], figures.get("free_drafts"),
                                 figures.get("weights_in_cache"), figures.get("verify_cost"),
                                 figures.get("drafted_ahead")))
    overhead = figures.get("overhead")
    if overhead is not None and overhead > OVERHEAD_LIMIT:
        lines.append(f"3. overhead: the work between a round's passes costs {overhead:.2f} plain steps "
                     f"a round (above {OVERHEAD_LIMIT:.2f}): a small model's step is short; longer rounds "
                     f"(higher k, copies) spread it.")
    elif overhead is not None:
        lines.append(f"3. overhead: {overhead:.2f} plain steps a round between the passes.")
    if "long_context" in figures:
        lines.append(_context(figures))
    prefill = figures.get("prefill")
    if prefill and prefill["share"] >= PREFILL_SHARE:
        lines.append(_prefill(prefill["share"], prefill["decode"]))
    if figures.get("speedups"):
        lines.append(_verdict(figures["speedups"]))
    return lines


def _prefill(share: float, decode: float) -> str:
    """Check 5: the prompts' pass, a share of plain decoding's time that no drafter speeds up."""
    end_to_end = 1 / (share + (1 - share) / decode)
    return (f"5. prefill: the prompts' pass takes {share:.0%} of plain decoding's time, the same for every "
            f"method, so the fastest decoding ({decode:.2f}× plain after the prefill) shows as "
            f"{end_to_end:.2f}× end to end; longer replies show more of it.")


def _acceptance(figures: dict) -> str:
    """Check 1: the early exit's α against the α its measured c and v need."""
    alpha, k, c, v = figures["alpha"], figures["k"], figures["draft_cost"], figures["verify_cost"]
    exit_layer = figures["exit_layer"]
    need = break_even_acceptance(figures.get("k_rounds") or {k: 1}, c, v)
    if need != need:
        return (f"1. acceptance: at c = {c:.2f} and v = {v:.2f} no α pays for k = {k} (k + 1 tokens cost "
                f"more than k + 1 plain steps): draft fewer tokens a round or from a shallower exit.")
    if alpha != alpha or alpha < need:
        shown = "not measured (no early-exit draft was tested)" if alpha != alpha else f"{alpha:.2f}"
        return (f"1. acceptance: the early exit's α {shown} at E = {exit_layer} is below the {need:.2f} "
                f"it needs at c = {c:.2f}, v = {v:.2f}, k = {k}: train the exit on your data "
                f"(`selfspec train`, `selfspec recipes`) or move E (`selfspec layers MODEL`).")
    return (f"1. acceptance: α {alpha:.2f} at E = {exit_layer} clears the {need:.2f} that "
            f"c = {c:.2f}, v = {v:.2f}, k = {k} need.")


def _draft_cost(c: float, weight: float, free_drafts: bool = False, in_cache: list[int] | None = None,
                v: float | None = None, ahead: float | None = None) -> str:
    """Check 2: the measured c against the share of the weights a draft step reads. free_drafts: the
    rounds drafted tokens without a model call beside the exit's (a grammar's forced tokens, copies),
    whose pass through blocks [0, E) the draft time holds. in_cache: [weight bytes, cache bytes]
    where the weights fit in the CPU's last-level cache (`weights_in_cache`); v: the verification's
    cost in plain steps; ahead: the share of rounds whose drafts ran beside the round before's
    verification (overlapped rounds)."""
    if ahead:
        verify = f" and v = {v:.2f}" if v is not None else ""
        return (f"2. draft cost: c = {c:.2f}{verify} plain steps as a round pays them (the weights predict "
                f"c = {weight:.2f} for a pass alone): {ahead:.0%} of the rounds drafted beside the round "
                f"before's verification (overlapped rounds), their drafts taking no time of their own, "
                f"while each pass runs on one thread.")
    if c > DRAFT_COST_MARGIN * weight and in_cache and not free_drafts:
        verify = f"; a verification costs v = {v:.2f} plain steps" if v is not None else ""
        return (f"2. draft cost: a draft step costs c = {c:.2f} plain steps, {c / weight:.2f}× the "
                f"{weight:.2f} its weights predict: the weights ({in_cache[0] / 2**20:.0f} MiB) fit in "
                f"the CPU's last-level cache ({in_cache[1] / 2**20:.0f} MiB), so a pass is bound by its "
                f"compute and per-step work, not by reading them, and each position costs its own"
                f"{verify}; the early exit gains most where the weights stream from memory (larger "
                f"models); here overlapped rounds (--overlap) give each core a pass of its own.")
    if c > DRAFT_COST_MARGIN * weight and free_drafts:
        return (f"2. draft cost: c = {c:.2f} plain steps per early-exit draft, {c / weight:.2f}× the "
                f"{weight:.2f} its weights predict; the draft passes also run the free drafts (forced "
                f"tokens, copies) through blocks [0, E), work the verification does otherwise, so c "
                f"overstates a step.")
    if c > DRAFT_COST_MARGIN * weight:
        return (f"2. draft cost: a draft step costs c = {c:.2f} plain steps, {c / weight:.2f}× the "
                f"{weight:.2f} its weights predict: per-step work beyond reading the weights; a "
                f"trimmed draft head (--draft-vocab-size) or a GPU's captured step cuts it.")
    return (f"2. draft cost: c = {c:.2f} plain steps, near the {weight:.2f} its weights predict "
            f"(E/N plus the head); a trimmed head (--draft-vocab-size) lowers the head's share.")


def _context(figures: dict) -> str:
    """Check 4: how c and v grow from the short context to the long one (both measured through the
    engine where the figures have them, else the probe's own c and v stand for the short one)."""
    c = figures.get("draft_cost_short") or figures["draft_cost"]
    v = figures.get("verify_cost_short") or figures["verify_cost"]
    c_long, v_long = figures.get("draft_cost_long"), figures.get("verify_cost_long")
    if c_long is None:
        return (f"4. context: not measured at {figures['long_context']} tokens (beyond the model's "
                f"positions with a round's k + 1): pass a shorter --long-context.")
    if c_long > CONTEXT_GROWTH * c or v_long > CONTEXT_GROWTH * v:
        return (f"4. context: at {figures['long_context']} tokens c = {c_long:.2f} and "
                f"v = {v_long:.2f} (at {figures['context']}: {c:.2f}, {v:.2f}); long contexts erode "
                f"the gain: `selfspec eval sweep --write-back` stores the round's costs by context length, "
                f"and decoding then drafts only where they pay.")
    return (f"4. context: c and v hold from {figures['context']} to {figures['long_context']} "
            f"tokens ({c:.2f} -> {c_long:.2f}, {v:.2f} -> {v_long:.2f}).")


def _verdict(speedups: dict) -> str:
    """Check 6: the fastest method measured, and what would change the verdict."""
    best = max(speedups, key=speedups.get)
    if speedups[best] <= 1.0:
        return (f"6. verdict: nothing beats plain decoding here (best {best} {speedups[best]:.2f}×); "
                f"train the exit, or decode under a grammar (--json-schema), where forced tokens and "
                f"copies pay.")
    others = ", ".join(f"{m} {s:.2f}×" for m, s in speedups.items() if m != best)
    others = f" ({others})" if others else ""  # a lone method: no empty parentheses
    change = ("the early exit would need the α above" if best != "early_exit"
              else "copies or the hybrid may add more where the text repeats")
    return f"6. verdict: {best} is fastest at {speedups[best]:.2f}× plain{others}; {change}."


def cost_figures(cost: dict, speedups: dict, exit_layer: int | None, overhead: float | None = None,
                 exit_alpha: float | None = None, prefill: dict | None = None) -> dict:
    """The checklist's figures from a report's cost model (`costs.cost_model`: α, mean k, the
    rounds per k, c, v and the weights' c) and its speedups over plain (method -> ×). exit_alpha: the
    α of the early exit's own drafts, where others were verified beside them (a grammar's forced
    tokens, which cost no draft step); default the cost model's α of all drafts. prefill: the
    report's `costs.prefill_split`."""
    figures = {"exit_layer": exit_layer, "speedups": speedups, "overhead": overhead,
               "weight_cost": cost.get("weight_cost"), "weights_in_cache": cost.get("weights_in_cache"),
               "free_drafts": exit_alpha is not None, "drafted_ahead": cost.get("drafted_ahead_share")}
    if "draft_cost" in cost:
        # the rounds' k counts every draft; beside other drafts, the exit's own mean k stands alone
        rounds = {int(k): n for k, n in (cost.get("k_rounds") or {}).items()} if exit_alpha is None else None
        figures.update(alpha=cost["acceptance_rate"] if exit_alpha is None else exit_alpha,
                       k=max(1, round(cost["mean_k"])), k_rounds=rounds, draft_cost=cost["draft_cost"],
                       verify_cost=cost["verify_cost"])
    plain = (prefill or {}).get("plain")
    if plain and len(prefill) > 1:
        fastest = max(row["decode_over_plain"] for method, row in prefill.items() if method != "plain")
        figures["prefill"] = {"share": plain["share"], "decode": fastest}
    return figures


def summary(figures: dict) -> str | None:
    """The checklist as one paragraph, as `eval speedup`, `sweep` and `suite` end (None: nothing
    measured to check)."""
    lines = diagnose(figures)
    if not lines:
        return None
    checks = [line.split(". ", 1)[1] for line in lines]
    return "Why it is (not) faster: " + " ".join(c[0].upper() + c[1:] for c in checks)


def own_exit_alpha(sources: dict) -> float | None:
    """The early exit's own α where other drafts shared its rounds (under a grammar its forced tokens,
    which cost no draft step), so that the checklist judges the exit by it; None when it drafted alone
    (`sources`: `costs.source_summary` of the early-exit method's runs)."""
    mixed = any(part["drafted"] for source, part in sources.items() if source != "early_exit")
    return sources["early_exit"]["acceptance_rate"] if mixed else None


__all__ = ["CONTEXT_GROWTH", "DRAFT_COST_MARGIN", "OVERHEAD_LIMIT", "PREFILL_SHARE", "cost_figures",
           "diagnose", "own_exit_alpha", "summary"]
