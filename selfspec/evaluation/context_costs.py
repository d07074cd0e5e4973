"""A round's costs by context length, measured through the engine: what the cost gate decides from.

`measure_round_costs` decodes a context of L tokens at each length L plainly, with the early exit at
each fixed k of 1..k (`generate(profile=True)`: the passes' own seconds) and with copies of fixed
lengths (the rounds' own clocks), interleaved over repeats, and returns the `decoding.RoundCosts` (c: a
draft step, s: what a drafted position adds to a verification, R(j): a whole round of j drafts, a round
of j copies, all in plain steps at that length), with each length's α and plain step beside them.
`selfspec eval sweep --write-back` stores the costs in selfspec.json (`round_costs`, per device type), where
`load_tuned` finds them; `selfspec doctor` and `selfspec eval speedup` print them by length.
"""

from __future__ import annotations

import statistics

from tqdm.auto import tqdm

from ..decoding import DecodeSettings, RoundCosts, SelfSpecGenerator
from ..decoding.controller import FixedK
from ..decoding.ngram import NGramConfig
from ..decoding.policy import CopyPolicy
from ..errors import UserError

# lengths a write-back measures: the cost of a pass grows about linearly in the context, so a few points
# a factor of 4 apart describe it, up to the model's limit or `AUTO_LONGEST` (each length's decodes
# prefill that many tokens; past the last the costs extrapolate along the last segment)
AUTO_LENGTHS = (64, 256, 1024)
AUTO_LONGEST = 4096
NEW_TOKENS = 32  # tokens each measuring decode makes after its context
ROOM = NEW_TOKENS + 16  # what a context leaves of the model's positions: the decode and a round's drafts
MEASURED_ROUNDS = 4  # whole rounds measured of 1..4 drafts (more: `RoundCosts.round_costs` extrapolates)
# copy rounds measured of these many copies (and of the settings' max_copy), on a context that repeats its
# first COPY_PERIOD tokens (half a shorter context), so that most rounds find a copy (between the counts:
# `RoundCosts` interpolates)
COPY_LENGTHS = (1, 2, 4, 8)
COPY_PERIOD = 32


def cost_lengths(spec: str | tuple, max_positions: int | None) -> tuple[int, ...]:
    """The context lengths to measure: "auto" (`AUTO_LENGTHS` below the model's limit, and the longest
    context that leaves `ROOM` positions, at most `AUTO_LONGEST`), "none" (none), or a comma list."""
    if isinstance(spec, tuple):
        lengths = spec
    elif spec == "none":
        return ()
    elif spec == "auto":
        longest = min((max_positions or AUTO_LONGEST + ROOM) - ROOM, AUTO_LONGEST)
        lengths = tuple(sorted({n for n in AUTO_LENGTHS if n < longest} | {longest}))
    else:
        try:
            lengths = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
        except ValueError:
            raise UserError(f"--cost-lengths takes 'auto', 'none' or a comma list of token counts, got "
                            f"{spec!r}") from None
    limit = max_positions and max_positions - ROOM
    if not lengths or min(lengths) < 1 or (limit and max(lengths) > limit):
        raise UserError(f"--cost-lengths must lie in 1..{limit or 'the model limit'} (the model's positions "
                        f"less {ROOM} for the measuring decode), got {list(lengths)}")
    return lengths


def context_of(tokens: list[int], length: int) -> list[int]:
    """`length` tokens: `tokens` repeated (a pass's cost does not depend on what the context says)."""
    if not tokens:
        raise UserError("measuring round costs needs at least one prompt token")
    return (tokens * (length // len(tokens) + 1))[:length]


def _decode_seconds(stats) -> float:
    return stats.total_time - stats.prefill_time


def _per_pass(stats, part: str, count: int) -> float:
    return stats.profile[part] / max(count, 1)


def measure_round_costs(generator: SelfSpecGenerator, tokens: list[int], settings: DecodeSettings,
                        lengths: tuple[int, ...], new_tokens: int = NEW_TOKENS, repeats: int = 3,
                        progress: bool = True) -> tuple[RoundCosts, list[dict]]:
    """The round's costs at each context length (`RoundCosts`) and a row per length (L, plain step
    seconds, c, s, α, the rounds of 1..k drafts): `settings`' early exit (E, V', adapter) drafting j
    drafts a round for j = 1..k (k its k when fixed, else 2, at least 2; whole rounds up to
    `MEASURED_ROUNDS` drafts, and k itself for c and s; η off, no overlap, so that each
    pass is timed alone) against plain steps, on a context of `tokens` repeated to L, `repeats`
    interleaved repeats (median). c, s and α are those at k; a round's cost is its passes' (draft loop
    and verification) over a plain step's. A round of j copies (j in `COPY_LENGTHS` and the settings'
    max_copy) likewise: its lookup and verification over a plain step's, on a context repeating its first
    `COPY_PERIOD` tokens, over the same run's plain steps (none stored where some copy length never found
    a copy). With `settings.overlap` the k drafts with overlapped rounds too: their speed over the
    drafts' without (`overlap_gain`, decode time only). The generator's own gate is off while it measures."""
    k = settings.num_speculations
    k = max(k, 2) if isinstance(k, int) and k else 2
    drafting = [settings.override(drafter="early_exit", num_speculations=j, stop_below=0.0, overlap=False)
                for j in sorted({*range(1, min(k, MEASURED_ROUNDS) + 1), k})]
    plain = settings.override(drafter="early_exit", num_speculations=0)
    overlapped = drafting[-1].override(overlap=True) if settings.overlap else None
    ngram = settings.ngram
    copying = settings.override(drafter="ngram", stop_below=0.0, overlap=False)  # the `ngram` drafter's path
    copy_lengths = tuple(sorted({j for j in COPY_LENGTHS if j < ngram.max_copy} | {ngram.max_copy}))
    kept, generator.round_costs = generator.round_costs, None
    rows = []
    try:
        for length in tqdm(lengths, desc="round costs", unit="length", disable=not progress):
            context = context_of(tokens, length)
            repeating = context_of(tokens[:min(COPY_PERIOD, max(length // 2, 1))], length)
            samples = {key: [] for key in ("plain", "c", "s", "alpha", "overlap_gain", "rounds", "copies")}
            for repeat in range(repeats + 1):  # the first, untimed: warms the caches and the kernels
                order = [plain, *drafting, overlapped, *copy_lengths]
                order = [s for s in (order if repeat % 2 else order[::-1]) if s is not None]
                runs = {}
                for s in order:
                    if isinstance(s, int):  # j copies a round, copies alone (the `ngram` drafter's rounds)
                        # any one-token match copies: a round whose bonus token left the cycle still copies
                        policy = CopyPolicy(NGramConfig(ngram.max_ngram, 1, s), FixedK(0), FixedK(s))
                        runs[s] = generator.generate([repeating], max_new_tokens=new_tokens, eos_token_id=[],
                                                     settings=copying, drafter=policy).stats
                    else:
                        runs[id(s)] = generator.generate([context], max_new_tokens=new_tokens,
                                                         eos_token_id=[], settings=s, profile=True).stats
                if not repeat:
                    continue
                base, spec = runs[id(plain)], runs[id(drafting[-1])]
                step = _per_pass(base, "verification pass", base.rounds)
                samples["copies"].append([_copy_round(runs[j], base) for j in copy_lengths])
                samples["plain"].append(step)
                samples["c"].append(_per_pass(spec, "draft passes", spec.draft_steps) / step)
                verify = _per_pass(spec, "verification pass", spec.rounds - spec.plain_steps) / step
                samples["s"].append(max(0.0, (verify - 1.0) / k))
                samples["alpha"].append(spec.acceptance_rate)
                samples["rounds"].append([_round(runs[id(s)]) / step for s in drafting[:MEASURED_ROUNDS]])
                if overlapped is not None:
                    ahead = runs[id(overlapped)]
                    samples["overlap_gain"].append(_decode_seconds(spec) / _decode_seconds(ahead))
            keys = ("c", "s", "alpha", "overlap_gain") if overlapped is not None else ("c", "s", "alpha")
            copies = [[x for x in r if x is not None] for r in zip(*samples["copies"])]
            rows.append({"length": length, "plain_step_seconds": statistics.median(samples["plain"]),
                         **{key: statistics.median(samples[key]) for key in keys},
                         "rounds": [statistics.median(r) for r in zip(*samples["rounds"])],
                         "copy_lengths": list(copy_lengths),
                         "copy_rounds": [statistics.median(r) if r else None for r in copies]})
    finally:
        generator.round_costs = kept
    copied = all(None not in r["copy_rounds"] for r in rows)
    costs = RoundCosts(*(tuple(r[key] for r in rows) for key in ("length", "c", "s")), settings.exit_layer,
                       settings.draft_vocab_size, tuple(r.get("overlap_gain", 1.0) for r in rows)
                       if overlapped is not None else (), tuple(tuple(r["rounds"]) for r in rows),
                       copy_lengths if copied else (),
                       tuple(tuple(r["copy_rounds"]) for r in rows) if copied else ())
    return costs, rows


def _copy_round(stats, plain) -> float | None:
    """A copy run's drafted round over a plain step, both by the rounds' own clocks
    (`GenerationStats.draft_time` + `verify_time` over its drafted rounds, `plain_time` over plain steps):
    the same run's plain steps (rounds that found no copy), so that both sides ran in the same seconds of
    the machine, else the plain run's (`plain`). None where no round copied."""
    drafted = stats.rounds - stats.plain_steps
    if not drafted:
        return None
    source = stats if stats.plain_steps else plain
    step = source.plain_time / max(source.plain_steps, 1)
    return max((stats.draft_time + stats.verify_time) / drafted, step) / step


def _round(stats) -> float:
    """Seconds of a drafted round's passes (its draft loop and its verification)."""
    drafted = stats.rounds - stats.plain_steps
    return _per_pass(stats, "draft passes", drafted) + _per_pass(stats, "verification pass", drafted)


def costs_table(rows: list[dict], k: int = 2) -> str:
    """Markdown: per context length, the plain step, c, the verification of k drafts (1 + k·s), the
    measured rounds of 1, 2, ... drafts and of j copies, α, and the speedup the cost model expects at
    that α."""
    from ..metrics import expected_tokens

    lines = [f"| context | plain step | c (draft step) | v (verify k={k}) | rounds of 1, 2, ... drafts | "
             f"rounds of j copies | α | expected speedup at k={k} |", "|---:" * 8 + "|"]
    for r in rows:
        verify = 1 + k * r["s"]
        measured = r.get("rounds", [])
        cost = measured[k - 1] if k <= len(measured) else k * r["c"] + verify
        expected = expected_tokens(k, min(max(r["alpha"], 0.0), 1.0)) / cost
        copies = ", ".join(f"{j}: {'-' if x is None else f'{x:.3f}'}"
                           for j, x in zip(r.get("copy_lengths", []), r.get("copy_rounds", [])))
        lines.append(f"| {r['length']} | {r['plain_step_seconds'] * 1e3:.2f} ms | {r['c']:.3f} | "
                     f"{verify:.3f} | {', '.join(f'{x:.3f}' for x in measured) or '-'} | {copies or '-'} | "
                     f"{r['alpha']:.3f} | {expected:.2f}x |")
    return "\n".join(lines)


__all__ = ["AUTO_LENGTHS", "AUTO_LONGEST", "COPY_LENGTHS", "COPY_PERIOD", "MEASURED_ROUNDS", "NEW_TOKENS",
           "ROOM", "context_of", "cost_lengths", "costs_table", "measure_round_costs"]
