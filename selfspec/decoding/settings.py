"""`DecodeSettings`: how one decode drafts, in one frozen value.

The drafter, the exit layer E, the early exit's draft length k, the draft head's vocabulary V' and
the copy settings travel together from `selfspec.json` (`DecodeSettings.from_json`, `to_json`) to
`SelfSpecGenerator`, `load_tuned`, the benchmark, the sweep and the CLI; nothing translates between
other shapes of the same settings. A copy with some fields changed is `override(...)` (None keeps a
field), which is where the CLI's flags and `load_tuned`'s arguments land.

    settings = DecodeSettings(drafter="hybrid", exit_layer=10, num_speculations="auto",
                              draft_vocab_size=8192)
    settings.override(min_ngram=3).describe()   # "hybrid, E = 10, k = auto, V' = 8192, min_ngram = 3"
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..errors import UserError
from .ngram import NGramConfig
from .policy import DRAFTERS, DraftPolicy, make_policy

ADAPTIVE_K = ("auto", "window")  # draft lengths chosen per round by a controller (see controller.py)
# as selfspec.json names them
FIELDS = ("drafter", "exit_layer", "num_speculations", "draft_vocab_size", "stop_below", "ngram", "overlap",
          "fused")


def parse_num_speculations(value) -> int | str:
    """k as a user writes it: an int >= 0 (or its digits), "auto" or "window"; UserError otherwise."""
    if value in ADAPTIVE_K:
        return value
    try:
        k = int(value)
    except (TypeError, ValueError):
        k = -1
    if k < 0 or isinstance(value, (bool, float)):
        raise UserError(f"num_speculations {value!r} is not allowed; pass an integer k >= 0, auto or window")
    return k


@dataclass(frozen=True)
class DecodeSettings:
    """How a decode drafts (every field is a choice of speed, never of output: all are lossless).

    drafter: "early_exit" (the first E blocks draft), "ngram" (copies from the context, plain steps
        otherwise) or "hybrid" (copies when the context has a match, the early exit otherwise).
    exit_layer: E, the blocks the early exit runs (1..N); None: not chosen yet (the model's own).
    num_speculations: k, the early exit's drafts per round: an int (0: plain decoding), "auto"
        (the cost model per round) or "window" (the articles' rule).
    draft_vocab_size: V', the early exit drafts among the V' most frequent tokens; 0: the whole head.
    stop_below: η, the early exit stops a round's drafts once its draft's top probability falls
        below η (Kangaroo: 0.6 at batch 1; in a batch, once no row's reaches it); 0: never stops.
    ngram: the copy settings of "ngram" and "hybrid".
    overlap: verify a round on one thread while another drafts the next round from the exit's guess of
        the target's next token (kept when the target accepts every draft and that guess): greedy or
        sampled (the guess then raced with the target's own number, `sampling.sample`), one row, the
        CPU kernels' rounds in one call (`backends.cpu_rounds.greedy_rounds`). Each pass then
        runs on one thread, so it pays where one thread runs a pass nearly as fast as all of them (a
        small model on a few cores); the same drafts, tokens and statistics either way.
    fused: a lone unconstrained row's rounds run many in one compiled call where the backend has them
        (`Backend.greedy_rounds`); False: each round from Python. The same rounds either way (the
        tests hold them round for round); which is faster depends on the drafter and the model (the
        fused loop adapts k and copy lengths between calls, the Python round between rounds), so
        `selfspec eval sweep` times its picks both ways and stores the faster.
    """

    drafter: str = "early_exit"
    exit_layer: int | None = None
    num_speculations: int | str = "auto"
    draft_vocab_size: int = 0
    stop_below: float = 0.0
    ngram: NGramConfig = field(default_factory=NGramConfig)
    overlap: bool = False
    fused: bool = True

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise UserError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.exit_layer is not None and (isinstance(self.exit_layer, bool)
                                            or not isinstance(self.exit_layer, int)
                                            or self.exit_layer < 1):
            raise UserError(f"exit_layer must be an int >= 1 (the blocks the draft runs), "
                            f"got {self.exit_layer!r}")
        object.__setattr__(self, "num_speculations", parse_num_speculations(self.num_speculations))
        size = self.draft_vocab_size
        if size is None:
            size = 0
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise UserError(f"draft_vocab_size must be an int >= 0 (0: the whole head), got {size!r}")
        object.__setattr__(self, "draft_vocab_size", size)
        value = self.stop_below
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise UserError(f"stop_below (η) must be a number in [0, 1) (0: never stop drafting), "
                            f"got {value!r}")
        object.__setattr__(self, "stop_below", float(value))
        if not isinstance(self.ngram, NGramConfig):
            raise UserError(f"ngram must be an NGramConfig, got {self.ngram!r}")
        for name in ("overlap", "fused"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def is_plain(self) -> bool:
        """Plain decoding: the early exit with k = 0 drafts nothing."""
        return self.drafter == "early_exit" and self.num_speculations == 0

    def override(self, *, drafter: str | None = None, exit_layer: int | None = None, num_speculations=None,
                 draft_vocab_size: int | None = None, stop_below: float | None = None,
                 ngram: NGramConfig | None = None, min_ngram: int | None = None,
                 overlap: bool | None = None, fused: bool | None = None) -> DecodeSettings:
        """A copy with the given fields changed; None keeps a field. `min_ngram` moves the copy
        threshold (and raises `max_ngram` to it when needed; `max_copy` stays) of `ngram`, the copy
        settings (`NGramConfig`)."""
        changes = {name: value for name, value in (("drafter", drafter), ("exit_layer", exit_layer),
                                                   ("num_speculations", num_speculations),
                                                   ("draft_vocab_size", draft_vocab_size),
                                                   ("stop_below", stop_below), ("ngram", ngram),
                                                   ("overlap", overlap), ("fused", fused))
                   if value is not None}
        if min_ngram is not None:
            old = changes.get("ngram", self.ngram)
            try:
                changes["ngram"] = NGramConfig(max(old.max_ngram, min_ngram), min_ngram, old.max_copy)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        return dataclasses.replace(self, **changes) if changes else self

    def policy(self, controller=None, gate=None) -> DraftPolicy:
        """The drafting policy of these settings; `controller` replaces the early exit's k (a
        `Controller`); `gate` the `CostGate` its rounds pass through."""
        return make_policy(self.drafter, self.num_speculations if controller is None else controller,
                           self.ngram, gate)

    def describe(self) -> str:
        """One line, e.g. "hybrid, E = 10, k = auto, V' = 8192, min_ngram = 2"."""
        if self.is_plain:
            return "plain"
        parts = [self.drafter]
        if self.drafter != "ngram":
            parts += [f"E = {self.exit_layer}", f"k = {self.num_speculations}"]
            parts += [f"V' = {self.draft_vocab_size}"] if self.draft_vocab_size else []
            parts += [f"η = {self.stop_below:g}"] if self.stop_below else []
            parts += ["overlapped"] if self.overlap else []
        if self.drafter != "early_exit":
            parts.append(f"min_ngram = {self.ngram.min_ngram}")
        return ", ".join(parts + ([] if self.fused else ["rounds from Python"]))

    def to_json(self) -> dict:
        """The fields as `selfspec.json` stores them (top level, and each entry of "fastest")."""
        return {"drafter": self.drafter, "exit_layer": self.exit_layer,
                "num_speculations": self.num_speculations,
                "draft_vocab_size": self.draft_vocab_size, "stop_below": self.stop_below,
                "ngram": self.ngram.as_dict(), "overlap": self.overlap, "fused": self.fused}

    @classmethod
    def from_json(cls, entry: dict, default: DecodeSettings | None = None) -> DecodeSettings:
        """From the settings of a `selfspec.json` (`to_json`'s fields; a missing one takes `default`'s,
        a null `draft_vocab_size` is the whole head); an unknown key is a UserError."""
        unknown = set(entry) - set(FIELDS)
        if unknown:
            raise UserError(f"unknown decode settings {sorted(unknown)}; the fields are {', '.join(FIELDS)} "
                            f"(re-run `selfspec eval sweep --write-back` to rewrite them)")
        known = dict(entry)
        if "ngram" in known:
            try:
                known["ngram"] = NGramConfig.from_dict(known["ngram"])
            except (TypeError, ValueError) as exc:
                raise UserError(f"bad \"ngram\" entry ({exc})") from None
        if known.get("draft_vocab_size") is None:
            known.pop("draft_vocab_size", None)
        return dataclasses.replace(default or cls(), **known)


PLAIN = DecodeSettings(num_speculations=0)
# The `format_settings` key (selfspec.json's `formats`) of the settings a sweep picked for sampled calls
# (temperature > 0): their acceptance and so their fastest k differ from greedy's, and from one
# temperature to another (sharper distributions accept more: a longer k pays), so a sampled sweep stores
# its pick under its temperature (`sampled_key`) and a call decodes at the nearest one's (`sampled_pick`).
SAMPLED = "sampled"


def sampled_key(temperature: float) -> str:
    """The `formats` key of a sampled sweep's pick at `temperature`: "sampled@0.8"."""
    return f"{SAMPLED}@{temperature:g}"


def sampled_pick(keys, temperature: float) -> str | None:
    """Which stored sampled pick (among `formats` keys `keys`) decodes a call at `temperature` > 0: the
    one measured at the nearest temperature, by ratio (0.5 is nearer 0.8 than 0.3), the lower on a tie;
    else one stored without a temperature (`SAMPLED`); else None."""
    stored = {}
    for key in keys:
        name, _, at = key.partition("@")
        try:
            if name == SAMPLED and at and float(at) > 0:
                stored[float(at)] = key
        except ValueError:
            continue
    if stored and temperature > 0:
        return stored[min(stored, key=lambda t: (abs(math.log(t / temperature)), t))]
    return SAMPLED if SAMPLED in keys else None


# The `format_settings` key prefix of a greedy pick for long contexts: a draft's acceptance falls with the
# context while a round's verification grows dearer than a plain step, so the (E, k) that pays most after
# short prompts (a shallow exit, longer drafts) loses to a deeper exit with shorter drafts after long
# ones (figures: docs/results.md, "Long contexts"). A sweep after long prompts stores its pick under
# "context@T", and a greedy decode switches to it once its longest context reaches T tokens
# (`engine.ContextSwitch`).
CONTEXT = "context"


def context_key(from_tokens: int) -> str:
    """The `formats` key of the pick that greedy decodes switch to from `from_tokens` of context on."""
    return f"{CONTEXT}@{from_tokens}"


def context_picks(keys) -> list[tuple[int, str]]:
    """The stored long-context picks among `formats` keys `keys`: (from_tokens, key), ascending."""
    picks = []
    for key in keys:
        name, _, at = key.partition("@")
        if name == CONTEXT and at.isascii() and at.isdigit() and int(at) > 0:
            picks.append((int(at), key))
    return sorted(picks)


__all__ = ["ADAPTIVE_K", "CONTEXT", "FIELDS", "PLAIN", "SAMPLED", "DecodeSettings", "context_key",
           "context_picks", "parse_num_speculations", "sampled_key", "sampled_pick"]
