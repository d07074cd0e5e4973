"""The round profile: where each decoding method's rounds spend their time, part by part.

Each engine method decodes the same prompts with `generate(profile=True)`, interleaved over
repeats as in the benchmark; every round's time is split into `decoding.profile.PARTS` (the
passes, and what sits between them). The report gives each part in µs per round and in plain steps
(a plain step: plain decoding's whole round, its pass and its own overhead), and three sums:

- round: everything a round costs;
- outside the passes: every part but the draft passes and the verification pass (the overhead a
  round that cost only its passes would not have);
- after the drafts: the verification pass, acceptance, rollback, statistics, policy and the rest of
  the loop: what the cost model calls the verification, v (grammar work is reported on its own).

    selfspec eval roofline --model runs/demo/model          # passes, then this profile
    selfspec eval speedup --model runs/demo/model --profile # this profile for every engine method
"""

from __future__ import annotations

from ..decoding.profile import PARTS, PASSES, overhead

AFTER_DRAFTS = ("verification pass", "acceptance", "rollback", "statistics", "policy", "other")


def round_profile(runs: dict[str, list]) -> dict:
    """Per method (name -> its runs' `GenerationStats`, profiled), seconds per round of each part and
    the sums above, rounds, tokens per round and draft passes per round. The plain step is the
    "plain" method's round when it is among them (its fractions are then filled in)."""
    methods = {}
    for name, stats in runs.items():
        profiled = [s for s in stats if s.profile is not None]
        rounds = sum(s.rounds for s in profiled)
        if not rounds:
            continue
        parts = {part: sum(s.profile[part] for s in profiled) / rounds for part in PARTS}
        methods[name] = {
            "rounds": rounds, "parts": parts,
            "tokens_per_round": sum(s.generated_tokens for s in profiled) / rounds,
            "draft_steps_per_round": sum(s.draft_steps for s in profiled) / rounds,
            "round": sum(parts.values()), "outside_passes": overhead(parts),
            "after_drafts": sum(parts[part] for part in AFTER_DRAFTS)}
    plain = methods.get("plain", {}).get("round")
    for row in methods.values():
        row["plain_steps"] = ({key: row[key] / plain for key in ("round", "outside_passes", "after_drafts")}
                              | {part: seconds / plain for part, seconds in row["parts"].items()}
                              if plain else None)
    return {"plain_step_seconds": plain, "methods": methods}


def to_markdown(profile: dict) -> str:
    """One table: a row per part, per method its µs per round and (with plain) plain steps."""
    methods = profile["methods"]
    if not methods:
        return ""
    names = list(methods)
    with_plain = profile["plain_step_seconds"] is not None

    def cell(row: dict, seconds: float, key: str) -> str:
        text = f"{seconds * 1e6:.0f}"
        return text + (f" ({row['plain_steps'][key]:.3f})" if with_plain else "")

    lines = ["| part | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for part in PARTS:
        lines.append(f"| {part}{' (pass)' if part in PASSES else ''} | "
                     + " | ".join(cell(methods[n], methods[n]["parts"][part], part) for n in names) + " |")
    for key, label in (("round", "**round**"), ("outside_passes", "outside the passes"),
                       ("after_drafts", "after the drafts (v)")):
        lines.append(f"| {label} | " + " | ".join(cell(methods[n], methods[n][key], key) for n in names)
                     + " |")
    lines.append("| tokens per round | " + " | ".join(f"{methods[n]['tokens_per_round']:.2f}" for n in names)
                 + " |")
    lines.append("| draft passes per round | "
                 + " | ".join(f"{methods[n]['draft_steps_per_round']:.2f}" for n in names) + " |")
    unit = "µs per round" + (" (plain steps)" if with_plain else "")
    return f"Round profile, {unit}, summed over every timed run:\n\n" + "\n".join(lines) + "\n"


__all__ = ["AFTER_DRAFTS", "round_profile", "to_markdown"]
