"""Grammar-constrained decoding: the output follows a JSON schema, a regex or a Lark grammar.

`llguidance` (the grammar engine of vLLM and SGLang; the optional extra `selfspec[structured]`)
compiles the constraint and, for one row's output so far, gives the mask of tokens the grammar
allows next. Constrained decoding picks from the target's logits with every disallowed token at
-inf; that masked and renormalised distribution is the target the engine stays lossless to. In a
speculative round:

- every draft is masked too: the early exit's logits (so its q is the masked distribution), and
  copies are cut at the first token the grammar refuses;
- the grammar's *forced* tokens are drafted without any model call: where the grammar allows only
  one continuation of bytes (`{"name": "` after the start of an object), llguidance's fast-forward
  tokens spell it in the tokenizer's own way. They are drafts like copies (one-hot q), verified in
  the same pass as the others, so a model that would spell them otherwise still gets its own tokens;
- the verification masks the target at each drafted prefix;
- the drafts go to a copy of each row's matcher; after the verification the matcher consumes the
  tokens its row emitted, as the KV cache keeps them.

A row ends when its grammar is complete and allows nothing more (a closing brace of the top-level
object): no eos token is needed after it. `GrammarBatch.complete` tells whether a row's output
reached an accepting state; a row cut by `max_new_tokens` before that is reported incomplete.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError
from ..sampling import apply_mask

# JSON as `json.dumps` writes it: ", " and ": ", no other whitespace. Models write JSON this way
# more often than any other spacing, and a compact grammar forces more of the output. A schema's
# own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "pip install 'selfspec[structured]' (or pip install llguidance)"
COMPILED_KEPT = 64  # compiled constraints a `GrammarTokenizer` keeps (`GrammarTokenizer.compiled`)
# The longest constraint text kept compiled: a huge enum or key list compiles to a matcher of hundreds of
# MiB, which a cache of 64 would hold on to; such a constraint compiles again where it is used.
COMPILED_KEPT_CHARS = 16 << 10


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise UserError(f"structured output needs the llguidance package: {INSTALL}") from None
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint: kind "json_schema", "regex" or "lark", and its text."""

    kind: str
    text: str

    @classmethod
    def of(cls, json_schema=None, regex: str | None = None, grammar: str | None = None) -> Constraint | None:
        """The constraint of whichever argument is given (a schema may be a dict or its JSON text);
        None when none is; a UserError when more than one is."""
        given = [(kind, value) for kind, value in (("json_schema", json_schema), ("regex", regex),
                                                   ("lark", grammar)) if value is not None]
        if len(given) > 1:
            names = " and ".join(kind for kind, _ in given)
            raise UserError(f"pass one of json_schema, regex and grammar, got {names}")
        if not given:
            return None
        kind, value = given[0]
        if kind == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise UserError(f"{kind} must be text, got {type(value).__name__}")
        return cls(kind, value)

    def keywords(self) -> dict:
        """This constraint as `generate`'s keyword argument: {"json_schema" | "regex" | "grammar": text}."""
        return {"grammar" if self.kind == "lark" else self.kind: self.text}

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (not yet checked against a tokenizer)."""
        matcher = _llguidance().LLMatcher
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.text)
            except json.JSONDecodeError as exc:
                raise UserError(f"the JSON schema is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                                f"{exc.msg}); fix the file") from None
            if not isinstance(schema, dict):
                raise UserError("the JSON schema must be a JSON object, e.g. {\"type\": \"object\", ...}")
            return matcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.text)
        return matcher.grammar_from_lark(self.text)


def constraints_for_rows(rows: int, json_schema=None, regex=None,
                         grammar=None) -> list[Constraint | None] | None:
    """One constraint per row from `generate`'s arguments: each may be one value for every row or a
    list with one entry (or None) per row. None when no row is constrained."""
    per_row = []
    for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)):
        if isinstance(value, (list, tuple)):
            if len(value) != rows:
                raise UserError(f"{name}: got {len(value)} entries for {rows} prompts; pass one per prompt")
            per_row.append(list(value))
        else:
            per_row.append([value] * rows)
    constraints = [Constraint.of(*row) for row in zip(*per_row)]
    return constraints if any(c is not None for c in constraints) else None


class GrammarTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (built once: it indexes the whole vocabulary).

    vocab_size: the model's logits width (it may exceed the tokenizer's; the extra ids are never
    allowed); eos: the token ids that may end an output where the grammar allows it to end.
    """

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        llguidance = _llguidance()
        if tokenizer is None:
            raise UserError("structured output needs the model's tokenizer: "
                            "SelfSpecGenerator(model, tokenizer)")
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            raise UserError(f"structured output needs a fast tokenizer, got {type(tokenizer).__name__}; "
                            f"load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
        self.vocab_size, self.eos = vocab_size, list(eos)
        try:
            self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.eos or None)
        except ValueError as exc:
            raise UserError(f"llguidance cannot read this tokenizer ({exc}); structured output needs a "
                            f"byte-level or byte-fallback tokenizer") from None
        self._compiled: OrderedDict = OrderedDict()  # Constraint -> its matcher, never consumed
        self._compiled_lock = threading.Lock()

    def matcher(self, constraint: Constraint):
        """A fresh matcher of `constraint`; a UserError that says where the grammar fails to compile."""
        llguidance = _llguidance()
        grammar = constraint.grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        if error and not error.startswith("WARNING"):
            where = " ".join(error.split())
            raise UserError(f"the {constraint.kind.replace('_', ' ')} does not compile: {where}")
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise UserError(f"the {constraint.kind.replace('_', ' ')} does not compile: "
                            f"{' '.join(matcher.get_error().split())}")
        self._check_first_token(constraint, matcher)
        return matcher

    def _check_first_token(self, constraint: Constraint, matcher) -> None:
        """A UserError when the grammar cannot produce its first token: llguidance builds parts of a
        grammar lazily, at the first mask (a repetition of a million, a schema that refers to itself),
        and a required cycle allows no token at all. Checked here, before a row decodes, so that such
        a grammar is refused with the request rather than failing its batch."""
        probe, words = matcher.deep_copy(), (self.vocab_size + 31) // 32
        bits = np.zeros(words, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        allowed[[t for t in self.eos if t < self.vocab_size]] = False
        if not allowed.any() and not probe.is_accepting():
            raise UserError("the grammar needs text this tokenizer's vocabulary cannot write; use a "
                            "byte-level tokenizer or a grammar over the characters it has")
        if probe.is_error():
            raise UserError(f"the {constraint.kind.replace('_', ' ')} does not compile: "
                            f"{' '.join(probe.get_error().split())[:500]}")

    def compiled(self, constraint: Constraint):
        """`constraint`'s compiled matcher, shared: the caller takes `deep_copy`s and never feeds it.
        The last `COMPILED_KEPT` are kept (those of at most `COMPILED_KEPT_CHARS` characters), so that a
        constraint compiled once (by the server, on a worker thread, as it checks a request) is not
        compiled again by every batch that decodes it.
        Thread-safe; a UserError as `matcher`'s."""
        with self._compiled_lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
        made = self.matcher(constraint)  # outside the lock: a large grammar compiles for a while
        if len(constraint.text) > COMPILED_KEPT_CHARS:
            return made
        with self._compiled_lock:
            self._compiled[constraint] = made
            self._compiled.move_to_end(constraint)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return made

    @property
    def kept(self) -> int:
        """How many compiled constraints are kept for reuse."""
        return len(self._compiled)

    def forget_compiled(self) -> int:
        """Drop every kept compiled constraint (an idle server: a short schema, `^a{1000000}$`, can hold
        tens of MiB, and what is idle should not); returns how many were kept."""
        with self._compiled_lock:
            kept = len(self._compiled)
            self._compiled.clear()
        return kept


class GrammarBatch:
    """The grammar state of a batch's rows (None for a row without a constraint) through the rounds.

    `matchers[s]` has consumed exactly the tokens its row emitted. A round drafts on a copy of it
    (`LLMatcher.deep_copy`, cheap), which consumes the drafts up to the first one its grammar
    refuses (the row is then `dead` for the rest of the round: its later drafts are rejected at
    verification whatever they are); the verification's masks come from another copy, and `commit`
    consumes what the row emitted. Copies rather than `LLMatcher.rollback`: in one SmolLM2 decode a
    matcher rolled back after a round's drafts had a mask that differed from a fresh matcher fed the
    same emitted tokens (cause not isolated; `tests/test_smollm2_slow.py` holds the case), while a
    committed state that never rolls back cannot drift. `seconds` adds up the time in llguidance.
    """

    def __init__(self, tokenizer: GrammarTokenizer, constraints: list[Constraint | None]):
        self.tokenizer = tokenizer
        self.vocab_size, self.eos = tokenizer.vocab_size, tokenizer.eos
        self.words = (tokenizer.vocab_size + 31) // 32  # int32 words of one bitmask
        self.compiled = {}  # one compiled matcher per distinct constraint; rows get copies (cheap)
        self.matchers: list = []
        self.drafting: list | None = None  # this round's drafting copies, made on first use
        self.complete: list[bool] = []  # per caller row: the output is accepted
        self.rows = np.zeros(0, dtype=np.int64)  # caller row of each slot
        self.dead = np.zeros(0, dtype=bool)
        self.executor = _llguidance().LLExecutor()
        self.seconds = 0.0
        self.add(constraints)

    def add(self, constraints: list[Constraint | None]) -> None:
        """Rows joining the batch (`Engine.add` after the first step), after the others: their caller
        rows follow the last one's."""
        for c in constraints:
            if c is not None and c not in self.compiled:
                self.compiled[c] = self.tokenizer.compiled(c)
        first = len(self.complete)
        self.matchers += [None if c is None else self.compiled[c].deep_copy() for c in constraints]
        self.complete += [c is None for c in constraints]
        self.rows = np.concatenate([self.rows, np.arange(first, first + len(constraints))])
        self.dead = np.concatenate([self.dead, np.zeros(len(constraints), dtype=bool)])
        self.drafting = None

    def _drafting(self) -> list:
        """The matchers the round's drafts go to: copies of the committed ones."""
        if self.drafting is None:
            self.drafting = [None if m is None else m.deep_copy() for m in self.matchers]
        return self.drafting

    # -- drafting --------------------------------------------------------------------------------
    def mask(self) -> torch.Tensor:
        """(B, V) bool: the tokens each row's grammar allows after the drafts so far (all for a
        dead or free row)."""
        start = time.perf_counter()
        matchers = self._drafting()
        bits = np.full((len(matchers), self.words), -1, dtype=np.int32)
        live = [(m, slot) for slot, m in enumerate(matchers) if m is not None and not self.dead[slot]]
        if live:
            self.executor.unsafe_compute_mask_ptr(live, bits.ctypes.data, self.words * 4, len(matchers))
        mask = self._unpack(bits)
        self.seconds += time.perf_counter() - start
        return mask

    def forced(self, limit: int) -> np.ndarray:
        """(B, f) the grammar's forced tokens (llguidance's fast-forward tokens) after each row's
        drafts so far, at most `limit`, consumed. Rows with fewer fill up with their last forced
        token (a draft the verification rejects: any draft is lossless). (B, 0) when no row has any."""
        start = time.perf_counter()
        runs = []
        for slot, m in enumerate(self._drafting()):
            run = [] if m is None or self.dead[slot] or limit <= 0 else m.compute_ff_tokens()[:limit]
            runs.append(run)
        width = max(len(r) for r in runs)
        out = np.zeros((len(runs), width), dtype=np.int64)
        for slot, run in enumerate(runs):
            if run:
                out[slot] = run + [run[-1]] * (width - len(run))
        self.seconds += time.perf_counter() - start
        if width:
            self.admit(out)
        return out

    def admit(self, tokens: np.ndarray) -> int:
        """Consume each row's drafts `tokens` (B, r) up to the first one its grammar refuses (that row
        is dead for the rest of the round); returns the longest valid run over the rows (free rows
        count r): the drafts after it are refused by every row and need not be verified."""
        start = time.perf_counter()
        longest = 0
        for slot, m in enumerate(self._drafting()):
            if m is None:
                longest = tokens.shape[1]
                continue
            if self.dead[slot]:
                continue
            row = tokens[slot].tolist()
            n = m.try_consume_tokens(row) if row else 0
            if n < len(row) or m.is_stopped():
                self.dead[slot] = True
            longest = max(longest, n)
        self.seconds += time.perf_counter() - start
        return longest

    def first_allowed(self, candidates: list[int]) -> np.ndarray | None:
        """(B,) per row the first of `candidates` its grammar allows after the drafts so far (not
        consumed; a dead or free row, or one that allows none, gets the first); None when no row
        allows any."""
        start = time.perf_counter()
        matchers = self._drafting()
        out = np.full(len(matchers), candidates[0] if candidates else 0, dtype=np.int64)
        found = False
        for slot, m in enumerate(matchers):
            if m is None or self.dead[slot]:
                continue
            allowed = next((c for c in candidates if m.validate_tokens([c]) == 1), None)
            if allowed is not None:
                out[slot], found = allowed, True
        self.seconds += time.perf_counter() - start
        return out if found else None

    # -- verification ----------------------------------------------------------------------------
    def verification_masks(self, drafts: np.ndarray) -> torch.Tensor:
        """(B, k + 1, V) bool: the masks of the target's k + 1 positions, at each drafted prefix of
        the round's drafts (B, k): per row, on a copy of its committed matcher, a mask, the next
        draft consumed, and so on. Masks after a draft the grammar refuses are left all-true: the
        verification never gets past that draft. Ends the round's drafting."""
        start = time.perf_counter()
        self.drafting, self.dead[:] = None, False
        B, k = drafts.shape
        bits = np.full((B * (k + 1), self.words), -1, dtype=np.int32)
        for slot, committed in enumerate(self.matchers):
            if committed is None:
                continue
            m, row = committed.deep_copy(), drafts[slot].tolist()
            for i in range(k + 1):
                target = bits[slot * (k + 1) + i]
                m.unsafe_compute_mask_ptr(target.ctypes.data, self.words * 4)
                if i == k or m.is_stopped() or not m.try_consume_tokens(row[i:i + 1]):
                    break  # the masks after a refused draft stay all-true: never reached
        mask = self._unpack(bits).reshape(B, k + 1, -1)
        self.seconds += time.perf_counter() - start
        self._check_writable(mask[:, 0])
        return mask

    def _check_writable(self, mask: torch.Tensor) -> None:
        """A UserError when a row's grammar, not yet complete, allows no token but eos (B, V): the
        vocabulary cannot write what it needs next."""
        allowed = mask.clone()
        allowed[:, [t for t in self.eos if t < self.vocab_size]] = False
        for slot, m in enumerate(self.matchers):
            if m is not None and not allowed[slot].any() and (m.is_error() or not m.is_accepting()):
                raise UserError("the grammar needs text this tokenizer's vocabulary cannot write; use a "
                                "byte-level tokenizer or a grammar over the characters it has")

    def commit(self, tokens: np.ndarray, emit: np.ndarray, finished: np.ndarray):
        """Consume each row's emitted tokens `tokens[s, :emit[s]]`; a row whose grammar is complete
        and allows nothing more ends there. Returns (emit, finished), both updated."""
        start = time.perf_counter()
        emit, finished = emit.copy(), finished.copy()
        for slot, m in enumerate(self.matchers):
            if m is None:
                continue
            for i in range(int(emit[slot])):
                if not m.consume_token(int(tokens[slot, i])):
                    error = " ".join(m.get_error().split())
                    if "TooComplex" in error or "too many" in error:  # llguidance's limits: the grammar's
                        raise UserError(f"the grammar grew past what the grammar engine can follow "
                                        f"(llguidance: {error[:300]}); simplify it (a self-reference, a huge "
                                        f"repetition)")
                    raise RuntimeError(f"the grammar refused an emitted token: {error}")
                if m.is_stopped():  # complete, nothing more allowed: the row ends with this token
                    emit[slot], finished[slot] = i + 1, True
                    break
            if finished[slot]:
                self.complete[self.rows[slot]] = bool(m.is_accepting() or m.is_stopped())
        self.seconds += time.perf_counter() - start
        return emit, finished

    def select_rows(self, keep: np.ndarray) -> None:
        """Keep the slots `keep` (indices), as the batch drops finished rows."""
        self.matchers = [self.matchers[i] for i in keep]
        self.rows, self.dead, self.drafting = self.rows[keep], self.dead[keep], None

    def _unpack(self, bits: np.ndarray) -> torch.Tensor:
        """int32 bitmasks (n, W), bit j of word w = token 32 w + j -> (n, V) bool."""
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(allowed.view(np.bool_))


class HFGrammarProcessor:
    """The same grammar for Hugging Face's `generate`, batch 1: a logits processor that masks the
    scores by llguidance's mask after the tokens generated so far, and a stopping criterion that
    ends the output where the grammar is complete. The peer a user would otherwise build by hand.

    Hugging Face's assisted generation calls the processor on prefixes of its candidates, which no
    grammar constrained, so each call goes back to the longest common prefix with what the matcher
    has consumed (a copy of the fresh matcher fed that prefix, as `GrammarBatch` avoids `rollback`),
    then consumes the rest as far as the grammar allows. After a refused candidate
    the scores are left as they are: that candidate is rejected (the mask before it refuses it), so
    nothing after it is kept.

        proc = HFGrammarProcessor(GrammarTokenizer(tok, V, [eos]), Constraint.of(json_schema=schema))
        model.generate(ids, logits_processor=[proc], stopping_criteria=[proc.stopping()])
    """

    def __init__(self, tokenizer: GrammarTokenizer, constraint: Constraint):
        self.tokenizer, self.constraint = tokenizer, constraint
        self.initial = tokenizer.matcher(constraint)  # never consumes: the start of every replay
        self.matcher = self.initial.deep_copy()
        self.words = (tokenizer.vocab_size + 31) // 32
        self.prompt_length: int | None = None
        self.seen: list[int] = []

    def follow(self, input_ids: torch.Tensor) -> bool:
        """Bring the matcher to `input_ids`' generated tokens; whether the grammar allows all of them."""
        if input_ids.shape[0] != 1:
            raise UserError("the Hugging Face grammar processor decodes batch 1 only")
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        generated = input_ids[0, self.prompt_length:].tolist()
        common = 0
        while common < min(len(generated), len(self.seen)) and generated[common] == self.seen[common]:
            common += 1
        if len(self.seen) > common:  # back to the common prefix
            self.matcher = self.initial.deep_copy()
            self.matcher.consume_tokens(generated[:common])
        rest = generated[common:]
        consumed = self.matcher.try_consume_tokens(rest) if rest else 0
        self.seen = generated[:common + consumed]
        return consumed == len(rest)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.follow(input_ids):
            return scores
        bits = np.full((1, self.words), -1, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, self.words * 4)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :scores.shape[-1]]
        return apply_mask(scores, torch.from_numpy(allowed.view(np.bool_)))

    def completed(self, sequence: torch.Tensor) -> list[int]:
        """The generated tokens of `sequence` (1, prompt + generated) up to where they complete the
        grammar: assisted generation accepts a round's tokens past that point before its stopping
        criterion looks, tokens a constrained decoder never emits."""
        self.follow(sequence)
        generated = sequence[0, self.prompt_length:].tolist()
        return generated[:len(self.seen)] if self.matcher.is_stopped() else generated

    def stopping(self):
        """A stopping criterion: True once the generated tokens complete the grammar (a prefix of them,
        under assisted generation, which may accept tokens past it in one round: `completed`)."""
        from transformers import StoppingCriteria

        processor = self

        class _Complete(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                processor.follow(input_ids)  # consumes up to the first token the grammar refuses
                done = processor.matcher.is_stopped()
                return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

        return _Complete()

def read_constraint(json_schema: str | None = None, regex: str | None = None,
                    grammar: str | None = None) -> Constraint | None:
    """The constraint of the CLI's flags: `json_schema` and `grammar` are file paths (a JSON schema,
    a Lark grammar), `regex` the expression itself. A missing file is a UserError."""
    from pathlib import Path

    texts = {}
    for flag, path in (("--json-schema", json_schema), ("--grammar", grammar)):
        if path is not None:
            if not Path(path).is_file():
                raise UserError(f"{flag} {path}: no such file")
            texts[flag] = Path(path).read_text()
    return Constraint.of(json_schema=texts.get("--json-schema"), regex=regex, grammar=texts.get("--grammar"))



__all__ = ["Constraint", "GrammarBatch", "GrammarTokenizer", "HFGrammarProcessor", "INSTALL",
           "JSON_DEFAULTS", "constraints_for_rows", "read_constraint"]
