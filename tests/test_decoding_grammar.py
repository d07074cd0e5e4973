"""Structured output: constrained self-speculative decoding equals constrained plain decoding.

The reference (`constrained_reference`) is independent of the engine: no cache, the whole model on
the whole sequence at each step, the target's logits masked by a fresh llguidance matcher, the
argmax taken, until the grammar is complete. Models are tiny and random (every family), with a
byte-level BPE tokenizer trained here on stdlib code and JSON, so any text can be written.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from helpers import FAMILIES, P_MIN, chi_square_p, kernels_unavailable, tiny_model

from selfspec.data import train_tokenizer
from selfspec.decoding import DecodeSettings, SamplingParams, SelfSpecGenerator
from selfspec.decoding.batch import no_lap
from selfspec.decoding.grammar import Constraint, GrammarBatch, GrammarTokenizer
from selfspec.errors import UserError

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Madrid", "Paris", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}

SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {  # nested object, array, boolean, optional field
        "order": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "paid": {"type": "boolean"}}, "required": ["id", "items", "paid"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 5}},
     "required": ["order"], "additionalProperties": False},
    {"type": "object", "properties": {  # a tool call: an enum of names, numbers with bounds
        "tool": {"enum": ["get_weather", "get_time"]},
        "arguments": {"type": "object", "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["lat", "unit"],
            "additionalProperties": False}},
     "required": ["tool", "arguments"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["sku", "qty"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
]


def _json_examples() -> list[str]:
    rows = [{"name": "Maria Lopez", "age": 34, "city": "Madrid"},
            {"order": {"id": 17, "items": ["pen", "ink"], "paid": True}, "note": "none"},
            {"tool": "get_weather", "arguments": {"lat": 40.4, "unit": "celsius"}},
            [{"sku": "AB-123", "qty": 2}]]
    return [json.dumps(r) for r in rows] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / name).read_text()[:20000] for name in ("json/encoder.py", "textwrap.py")]
    return train_tokenizer(texts + _json_examples(), tmp_path_factory.mktemp("tok"), vocab_size=400)


def make_model(family: str, tokenizer, seed: int = 0):
    return tiny_model(family, vocab_size=len(tokenizer), seed=seed, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.eos_token_id)


def constrained_reference(model, tokenizer, prompt: list[int], constraint: Constraint, max_new_tokens: int):
    """Constrained greedy decoding with no cache: (tokens, complete)."""
    vocab = model.config.vocab_size
    ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=tokenizer.eos_token_id)
    matcher = llguidance.LLMatcher(ll, constraint.grammar(), log_level=0)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
            logits = model(torch.tensor([ids])).logits[0, -1]
            logits[~torch.from_numpy(bits[:vocab].astype(bool))] = float("-inf")
            token = int(logits.argmax())
            assert matcher.consume_token(token)
            ids.append(token)
            out.append(token)
            if matcher.is_stopped() or token == tokenizer.eos_token_id:
                break
    return out, bool(matcher.is_accepting() or matcher.is_stopped())


def prompt_ids(tokenizer):
    # the prompt holds JSON the output may copy from
    return tokenizer('Text: Maria Lopez, 34, lives in Madrid. JSON: {"name": "Maria Lopez", "age": 34}. '
                     'Again as JSON:')["input_ids"]


DRAFTERS = {
    "plain": DecodeSettings(num_speculations=0),
    "early_exit": DecodeSettings(exit_layer=2, num_speculations=3),
    "ngram": DecodeSettings(drafter="ngram"),
    "hybrid": DecodeSettings(drafter="hybrid", exit_layer=1, num_speculations=2),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_under_a_json_schema_equals_constrained_plain_decoding(family, tokenizer):
    model = make_model(family, tokenizer)
    gen = SelfSpecGenerator(model, tokenizer, drafter="ngram")
    prompt = prompt_ids(tokenizer)
    expected, complete = constrained_reference(model, tokenizer, prompt, Constraint.of(PERSON), 60)
    for name, settings in DRAFTERS.items():
        out = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
        assert out.sequences[0] == expected, (family, name)
        assert out.complete == [complete]
        if name != "plain":  # the schema's keys and punctuation were drafted for free
            assert out.stats.forced.accepted > 0
        else:
            assert out.stats.forced.drafted == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_passes_under_a_json_schema_equal_constrained_plain_decoding(family, tokenizer):
    """Static passes (`backends.static_passes`) apply the grammar's masks inside the verification."""
    model = make_model(family, tokenizer)
    gen = SelfSpecGenerator(model, tokenizer, drafter="ngram", static_passes="eager")
    prompt = prompt_ids(tokenizer)
    expected, complete = constrained_reference(model, tokenizer, prompt, Constraint.of(PERSON), 60)
    for name, settings in DRAFTERS.items():
        out = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
        assert out.sequences[0] == expected and out.complete == [complete], (family, name)


def test_the_compiled_verification_applies_the_grammars_masks(tokenizer, monkeypatch):
    import selfspec.backends.cpu_rounds as round_kernels
    from selfspec.model import fast

    made = round_kernels.verify_greedy()
    if made is None:
        kernels_unavailable()
    calls = []
    monkeypatch.setattr(round_kernels, "verify_greedy", lambda: lambda *args: calls.append(1) or made(*args))
    model = make_model("llama", tokenizer)
    gen = SelfSpecGenerator(model, tokenizer, drafter="ngram")
    prompt = prompt_ids(tokenizer)
    for name, settings in DRAFTERS.items():
        compiled = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
        with fast.kernels_up_to("passes"):
            python = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
        assert compiled.sequences == python.sequences and compiled.complete == python.complete, name
        assert compiled.stats.accepted_histogram == python.stats.accepted_histogram, name
    assert calls


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_compiled_draft_step_applies_the_grammars_masks(family, tokenizer, monkeypatch):
    """Under a grammar each early-exit draft step is one call (`round_kernels.draft_step`), with the mask
    llguidance gave before it, behind an exit block or not, with η or not: the drafts, the statistics
    and the output of the step from Python, and constrained plain decoding's output."""
    import selfspec.backends.cpu_rounds as round_kernels
    from selfspec.model import fast
    from selfspec.model.exit_adapter import ExitBlock

    made = round_kernels.draft_step()
    if made is None:
        kernels_unavailable()
    calls = []  # the draft steps, and the passes without a choice (`exit_pass`: a tail behind the block)
    monkeypatch.setattr(round_kernels, "draft_step",
                        lambda: lambda *args: calls.append(args[-1]) or made(*args))
    model = make_model(family, tokenizer)
    block = ExitBlock.from_model(model, model.config.num_hidden_layers - 1).eval()
    prompt = prompt_ids(tokenizer)
    expected, complete = constrained_reference(model, tokenizer, prompt, Constraint.of(PERSON), 60)
    for adapters in ({}, {2: block}):
        gen = SelfSpecGenerator(model, tokenizer, exit_layer=2, exit_adapters=adapters)
        for settings in (DRAFTERS["early_exit"], DRAFTERS["hybrid"].override(exit_layer=2),
                         DecodeSettings(exit_layer=2, num_speculations=4, stop_below=0.3)):
            compiled = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
            with fast.kernels_up_to("passes"):
                python = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
            case = (family, bool(adapters), settings)
            assert compiled.sequences[0] == python.sequences[0] == expected, case
            assert compiled.complete == python.complete == [complete], case
            for name in ("accepted_histogram", "k_rounds", "draft_steps", "stopped_below_eta"):
                assert getattr(compiled.stats, name) == getattr(python.stats, name), (case, name)
    assert True in calls and False in calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_under_a_regex_and_a_lark_grammar(family, tokenizer):
    model = make_model(family, tokenizer, seed=1)
    gen = SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=3)
    prompt = prompt_ids(tokenizer)
    lark = 'start: "answer: " WORD ("," WORD)*\nWORD: /[a-z]{1,5}/'
    for kind, text in (("regex", r"(yes|no), because [a-z ]{3,20}\."), ("grammar", lark)):
        constraint = Constraint.of(**{"regex" if kind == "regex" else "grammar": text})
        expected, _ = constrained_reference(model, tokenizer, prompt, constraint, 40)
        for drafter in ("early_exit", "hybrid"):
            out = gen.generate([prompt], max_new_tokens=40, drafter=drafter, **{kind: text})
            assert out.sequences[0] == expected, (kind, drafter)


def test_a_batch_of_rows_with_their_own_grammars_equals_each_row_alone(tokenizer):
    model = make_model("llama", tokenizer, seed=2)
    gen = SelfSpecGenerator(model, tokenizer, drafter="hybrid", exit_layer=2, num_speculations=2)
    prompts = [prompt_ids(tokenizer), tokenizer("Order 17: pen and ink, paid.")["input_ids"],
               tokenizer("free text")["input_ids"]]
    schemas = [PERSON, SCHEMAS[1], None]  # the last row is unconstrained
    out = gen.generate(prompts, max_new_tokens=50, json_schema=schemas)
    for row, (prompt, schema) in enumerate(zip(prompts, schemas)):
        alone = gen.generate([prompt], max_new_tokens=50, json_schema=schema)
        assert out.sequences[row] == alone.sequences[0]
    assert out.complete[2] is True


def test_every_output_is_valid_json_of_its_schema(tokenizer):
    for seed in range(3):
        model = make_model("llama", tokenizer, seed=10 + seed)
        gen = SelfSpecGenerator(model, tokenizer, drafter="hybrid", exit_layer=2, num_speculations=3)
        for schema in SCHEMAS:
            out = gen.generate([prompt_ids(tokenizer)], max_new_tokens=170, json_schema=schema)
            assert out.complete == [True], (seed, schema, out.texts[0])
            jsonschema.validate(json.loads(out.texts[0]), schema)


def test_a_reply_cut_by_max_new_tokens_is_reported_incomplete(tokenizer):
    gen = SelfSpecGenerator(make_model("llama", tokenizer), tokenizer, drafter="ngram")
    out = gen.generate([prompt_ids(tokenizer)], max_new_tokens=5, json_schema=PERSON)
    assert out.complete == [False]
    assert len(out.sequences[0]) == 5


def test_a_copy_ends_where_its_clause_does_closed_as_the_grammar_allows(tokenizer):
    """Under a grammar a copy that runs past the context's clause (`Maria Lopez, 34, lives` for a name)
    is cut there and closed by the first closer the grammar allows there (a string's quote, not a
    comma, which would still be the string's text), so the key the grammar forces next can follow in
    the same round; where no closer fits, the copy is cut only where the grammar refuses it."""
    from types import SimpleNamespace

    gen = SelfSpecGenerator(make_model("llama", tokenizer), tokenizer, drafter="ngram")
    copy = np.array([tokenizer("Maria Lopez, 34, lives")["input_ids"]])
    end = gen.token_text.clause_end(copy)
    assert tokenizer.decode(copy[0, :end]) == "Maria Lopez"
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    grammar = GrammarBatch(gen.grammar_tokenizer(), [Constraint.of(schema)])
    opening = tokenizer('{"name": "')["input_ids"]
    assert grammar.admit(np.array([opening])) == len(opening)
    closed = gen.runner.drafter.copies.closed(SimpleNamespace(grammar=grammar, lap=no_lap), copy)
    assert closed.shape[1] == end + 1 and tokenizer.decode(closed[0]).startswith('Maria Lopez"')
    assert '"age": ' in tokenizer.decode(grammar.forced(8)[0])  # the drafts went to the matcher
    grammar = GrammarBatch(gen.grammar_tokenizer(), [Constraint.of(regex="[A-Za-z ]+[0-9]*")])
    batch = SimpleNamespace(grammar=grammar, lap=no_lap)
    assert gen.runner.drafter.copies.closed(batch, copy).tolist() == copy[:, :end].tolist()


def test_forced_runs_are_drafted_without_model_calls(tokenizer):
    """A schema whose output is almost all forced: the ngram drafter (no early exit) needs far fewer
    rounds than tokens, and every forced draft is accepted by the target."""
    schema = {"type": "object", "properties": {
        "first_property_name": {"const": "constant_value"},
        "second_property_name": {"enum": ["only_choice"]},
        "flag": {"type": "boolean"}},
        "required": ["first_property_name", "second_property_name", "flag"], "additionalProperties": False}
    model = make_model("llama", tokenizer, seed=4)
    expected, _ = constrained_reference(model, tokenizer, [5, 6, 7], Constraint.of(schema), 80)
    out = SelfSpecGenerator(model, tokenizer, drafter="ngram").generate([[5, 6, 7]], max_new_tokens=80,
                                                                        json_schema=schema)
    assert out.sequences[0] == expected
    assert out.stats.rounds * 3 < len(expected)
    forced = out.stats.forced
    assert forced.accepted >= len(expected) // 2


def test_a_rounds_copies_stay_within_the_copy_length_between_forced_runs(tokenizer, monkeypatch):
    """Under a grammar copies and forced runs alternate within a round; the copies add up to at most
    the copy controller's length (each is verified at a cost, and a chain is rarely accepted to its
    end), while forced runs, certain once reached, are not counted. Output: constrained decoding's."""
    from selfspec.decoding.ngram import NGramConfig
    from selfspec.decoding.speculative import GenerationStats

    rounds = []
    log_round = GenerationStats.log_round

    def logged(self, segments, accepted, k):  # each round's segments, then the engine's own logging
        rounds.append(segments)
        return log_round(self, segments, accepted, k)

    monkeypatch.setattr(GenerationStats, "log_round", logged)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    model = make_model("llama", tokenizer, seed=4)
    prompt = prompt_ids(tokenizer)
    expected, _ = constrained_reference(model, tokenizer, prompt, Constraint.of(schema), 40)
    settings = DecodeSettings(drafter="ngram", ngram=NGramConfig(min_ngram=1, max_copy=2))
    out = SelfSpecGenerator(model, tokenizer, settings).generate([prompt], max_new_tokens=40,
                                                                 json_schema=schema)
    assert out.sequences[0] == expected
    copied = [sum(s.length for s in segments if s.source == "copy") for segments in rounds]
    assert max(copied) == 2 and all(c <= 2 for c in copied)  # the copy length's bound, reached
    assert any(s.source == "forced" for segments in rounds for s in segments)


def test_rollback_after_rejection_restores_the_matcher(tokenizer):
    """Drafts consumed and rolled back, then the emitted tokens consumed: the same state (masks) as a
    matcher that only ever saw the emitted tokens."""
    gt = GrammarTokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraint = Constraint.of(PERSON)
    batch = GrammarBatch(gt, [constraint])
    fresh = gt.matcher(constraint)
    forced = batch.forced(16)[0].tolist()
    rest = tokenizer('{"name": "Ann", "age": 3'[len(tokenizer.decode(forced)):])["input_ids"]
    drafts = np.array([forced + rest[:3] + [tokenizer.eos_token_id]])
    batch.admit(drafts[:, len(forced):])  # the eos is refused: the row is dead for this round
    assert batch.dead[0]
    masks = batch.verification_masks(drafts)  # rolls every draft back
    assert masks.shape == (1, drafts.shape[1] + 1, len(tokenizer))
    assert not masks[0, -2, tokenizer.eos_token_id]  # the mask at the refused draft refuses it
    accepted = len(forced) + 1  # the round keeps some drafts and the target's next token
    emitted = drafts[:, :accepted + 1]
    batch.commit(emitted, np.array([accepted + 1]), np.array([False]))
    assert fresh.consume_tokens(emitted[0].tolist())
    expected = np.unpackbits(np.frombuffer(fresh.compute_bitmask(), np.uint8), bitorder="little")
    assert np.array_equal(batch.mask()[0].numpy(), expected[:len(tokenizer)].astype(bool))
    for i in range(drafts.shape[1]):  # and each verification mask is the mask after that prefix
        probe = gt.matcher(constraint)
        assert probe.consume_tokens(drafts[0, :i].tolist())
        bits = np.unpackbits(np.frombuffer(probe.compute_bitmask(), np.uint8), bitorder="little")
        assert np.array_equal(masks[0, i].numpy(), bits[:len(tokenizer)].astype(bool)), i



def test_random_rounds_keep_each_matcher_equal_to_one_fed_only_the_emitted_tokens(tokenizer):
    """Rounds of random drafts (forced tokens, allowed picks, refused tokens), their verification
    masks and a random accepted prefix: after each, the committed state's mask equals a fresh
    matcher's fed the emitted tokens alone, and the first verification mask is that mask."""
    rng = np.random.default_rng(0)
    gt = GrammarTokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraint = Constraint.of(SCHEMAS[1])
    batch, emitted = GrammarBatch(gt, [constraint]), []

    def fresh_mask():
        matcher = gt.matcher(constraint)
        assert matcher.consume_tokens(emitted)
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        return bits[:len(tokenizer)].astype(bool)

    for _ in range(40):
        drafts = [batch.forced(4)]
        for _ in range(int(rng.integers(0, 4))):
            allowed = np.nonzero(batch.mask()[0].numpy())[0]
            token = int(rng.choice(allowed)) if rng.random() < 0.8 else int(rng.integers(len(tokenizer)))
            batch.admit(np.array([[token]]))
            drafts.append(np.array([[token]]))
        drafts = np.concatenate(drafts, 1)
        masks = batch.verification_masks(drafts)
        assert np.array_equal(masks[0, 0].numpy(), fresh_mask())
        accepted = int(rng.integers(0, drafts.shape[1] + 1))
        for i in range(accepted):  # keep drafts only while the grammar took them
            if not masks[0, i, drafts[0, i]]:
                accepted = i
                break
        target = int(rng.choice(np.nonzero(masks[0, accepted].numpy())[0]))
        tokens = np.concatenate([drafts[:, :accepted], [[target]]], 1)
        emit, finished = batch.commit(tokens, np.array([accepted + 1]), np.array([False]))
        emitted += tokens[0, :emit[0]].tolist()
        if finished[0]:
            break
        assert np.array_equal(batch.mask()[0].numpy(), fresh_mask())
        batch.verification_masks(np.zeros((1, 0), dtype=np.int64))  # ends the probe's "round"


# -- sampling ------------------------------------------------------------------------------------
RUNS = 6000
REGEX = r"[a-e][a-z]{0,6}"  # a few dozen allowed first tokens, many second ones


@pytest.mark.parametrize("static_passes", [None, "eager"])
def test_sampling_under_a_grammar_matches_the_masked_target_distribution(tokenizer, static_passes):
    """Also on static passes (`backends.static_passes`: every pass at fixed shapes), which round otherwise."""
    model = make_model("llama", tokenizer, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # distributions far from uniform
    vocab, prompt = len(tokenizer), tokenizer("Write a word:")["input_ids"]
    gt = GrammarTokenizer(tokenizer, vocab, [tokenizer.eos_token_id])
    constraint = Constraint.of(regex=REGEX)
    params = SamplingParams(temperature=1.0)

    def mask_after(tokens):
        matcher = gt.matcher(constraint)
        assert matcher.consume_tokens(tokens)
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        return torch.from_numpy(bits[:vocab].astype(bool))

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
        first = params.probs(logits.masked_fill(~mask_after([]), float("-inf")))
        second = torch.zeros(vocab)
        allowed = torch.nonzero(first > 0)[:, 0].tolist()
        nexts = model(torch.tensor([prompt + [x] for x in allowed])).logits[:, -1]
        for row, x in enumerate(allowed):
            second += first[x] * params.probs(nexts[row].masked_fill(~mask_after([x]), float("-inf")))
    gen = SelfSpecGenerator(model, tokenizer, exit_layer=1, num_speculations=2, static_passes=static_passes)
    out = gen.generate([prompt] * RUNS, max_new_tokens=2, temperature=1.0, seed=0, regex=REGEX,
                       eos_token_id=[])
    rows = [s for s in out.sequences if len(s) == 2]  # a one-token word that ends the grammar stops early
    tokens = np.array([s[0] for s in out.sequences])
    early = out.stats.early_exit
    assert early.tested - early.accepted > RUNS // 5  # many rejections: the masked residual matters
    assert chi_square_p(tokens, first.double().numpy()) > P_MIN
    # the second token's distribution given that the row went on
    went_on = 1 - sum(float(first[x]) for x in allowed if mask_after([x]).sum() == 0)
    assert len(rows) > RUNS * went_on * 0.9
    assert chi_square_p(np.array([s[1] for s in rows]), second.double().numpy()) > P_MIN


# -- bad input -----------------------------------------------------------------------------------
def test_bad_constraints_are_one_line_user_errors(tokenizer):
    gen = SelfSpecGenerator(make_model("llama", tokenizer), tokenizer, drafter="ngram")
    prompt = [[5, 6]]
    cases = [
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "does not compile"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"regex": "a("}, "does not compile"),
        ({"grammar": "start: foo\n"}, "does not compile"),
        ({"regex": "a", "json_schema": PERSON}, "pass one of"),
        ({"json_schema": [PERSON, PERSON]}, "one per prompt"),
    ]
    for kwargs, words in cases:
        with pytest.raises(UserError, match=words) as info:
            gen.generate(prompt, max_new_tokens=4, **kwargs)
        assert "\n" not in str(info.value)


def test_a_slow_tokenizer_or_none_is_refused(tokenizer):
    class Slow:  # what a Python (non-fast) tokenizer lacks: the Rust backend
        eos_token_id = 0

    model = make_model("llama", tokenizer)
    with pytest.raises(UserError, match="fast tokenizer"):
        SelfSpecGenerator(model, Slow(), drafter="ngram").generate([[5]], max_new_tokens=2, regex="a")
    with pytest.raises(UserError, match="tokenizer"):
        SelfSpecGenerator(model, drafter="ngram").generate([[5]], max_new_tokens=2, regex="a")


def test_a_grammar_the_tokenizer_cannot_write_is_refused():
    """A byte-fallback (sentencepiece-like) vocabulary of a, b, c and no byte tokens cannot write z."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE({"<eos>": 0, "▁": 1, "a": 2, "b": 3, "c": 4}, [], byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    gen = SelfSpecGenerator(tiny_model("llama", vocab_size=5, eos_token_id=0), tok, drafter="ngram")
    assert gen.generate([[2, 3]], max_new_tokens=4, regex="(a|b)c").complete == [True]  # writable
    with pytest.raises(UserError, match="vocabulary cannot write"):
        gen.generate([[2, 3]], max_new_tokens=4, regex="z+")


def test_without_llguidance_the_error_names_the_install(tokenizer, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    gen = SelfSpecGenerator(make_model("llama", tokenizer), tokenizer, drafter="ngram")
    with pytest.raises(UserError, match=r"selfspec\[structured\]"):
        gen.generate([[5]], max_new_tokens=2, json_schema=PERSON)



def test_the_benchmark_times_every_method_under_each_prompts_schema(tokenizer):
    """`run_benchmark` with `Structured` prompts: the engine's methods and Hugging Face's greedy with
    the same masks give one output, its assisted methods too (cut where the grammar completed: they may
    accept tokens past it in one round); the report has the forced drafts and the grammar's cost."""
    from selfspec.evaluation.benchmark import run_benchmark, to_markdown
    from selfspec.evaluation.options import BenchmarkRun
    from selfspec.evaluation.prompts import Structured
    from selfspec.evaluation.timing import LoadedCheckpoint

    model = make_model("llama", tokenizer, seed=6)
    prompts = [Structured(prompt_ids(tokenizer), Constraint.of(schema)) for schema in SCHEMAS[:2]]
    checkpoint = LoadedCheckpoint(model, DecodeSettings(exit_layer=2, num_speculations=3), tokenizer)
    report = run_benchmark(checkpoint, prompts,
                           BenchmarkRun(max_new_tokens=80, repeats=1, warmup=0,
                                        methods=("plain", "early_exit", "ngram", "hybrid", "hf_greedy",
                                                 "hf_prompt_lookup", "hf_early_exit")))
    assert all(report["identical"].values()), report["identical"]
    assert report["sources"]["ngram"]["forced"]["accepted"] > 0
    assert report["grammar"]["seconds_per_token"] > 0
    assert "Grammar masks" in to_markdown(report)


def test_forced_flags_mark_the_tokens_the_engine_drafts_for_free(tokenizer):
    """A constrained reply replayed through its schema: the keys and the punctuation between them are
    forced, the values are the model's to choose; what the engine drafts as forced, the flags mark."""
    from selfspec.data.forced import forced_flags, grammar_tokenizer_for

    reply = json.dumps({"name": "Ana", "age": 7, "city": "Lima"})
    prompt = tokenizer("Q: who?")["input_ids"]
    ids = prompt + tokenizer(reply)["input_ids"]
    assistant = [False] * len(prompt) + [True] * (len(ids) - len(prompt))
    flags = forced_flags(ids, assistant, json.dumps(PERSON), grammar_tokenizer_for(tokenizer))
    assert not flags[:len(prompt)].any()
    forced = "".join(tokenizer.decode([t]) for t, f in zip(ids, flags) if f)
    free = "".join(tokenizer.decode([t]) for t, f in zip(ids, flags) if not f)
    assert all(key in forced for key in ("name", "age", "city")), forced
    assert "Ana" in free and "7" in free and "Lima" not in forced
    # the engine's own forced drafts at the reply's start are the flagged tokens there
    batch = GrammarBatch(GrammarTokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id]),
                         [Constraint.of(json_schema=PERSON)])
    run = batch.forced(20)[0].tolist()
    start = len(prompt)
    assert run and run == ids[start:start + len(run)] and flags[start:start + len(run)].all()
    assert not flags[start + len(run)]


def test_extraction_prompts_are_seeded_and_splits_share_no_record():
    from selfspec.data.extraction import CATEGORIES, extraction_prompts

    test = extraction_prompts("test", per_category=3)
    assert test == extraction_prompts("test", per_category=3)  # the same on every machine
    assert [p.category for p in test] == [c for c in CATEGORIES for _ in range(3)]
    train = extraction_prompts("train", per_category=30)
    identity = {"people": "name", "products": "product", "events": "title", "tool_calls": "arguments"}
    keys = {split: {json.dumps(p.record[identity[p.category]], sort_keys=True) for p in prompts}
            for split, prompts in (("train", train), ("test", test))}
    assert not keys["train"] & keys["test"]
    for p in test + train:  # every record is an answer its schema accepts
        jsonschema.validate(p.record, p.schema)


def test_extraction_prompts_do_not_depend_on_the_date(monkeypatch):
    """Faker's "this year" and "past/future" dates count from today: the prompts, and so the distilled
    data and the benchmark's prompts, must not use them (they would change from one day to the next)."""
    import faker.providers.date_time as faker_dates

    from selfspec.data.extraction import extraction_prompts

    def from_today(*args, **kwargs):
        raise AssertionError("a date relative to today")

    for name in dir(faker_dates.Provider):
        if "_this_" in name or name.startswith(("past_", "future_")) or name.endswith("_today"):
            monkeypatch.setattr(faker_dates.Provider, name, from_today)
    assert len(extraction_prompts("test", per_category=4)) == 16


def test_a_sweep_on_structured_prompts_stores_the_formats_own_setting(tokenizer, tmp_path):
    """`sweep --prompts json-extract --write-back` stores its pick under `formats`: calls under a JSON
    schema decode with it, free calls keep the checkpoint's own, and any setting the caller passes wins."""
    from selfspec import load_tuned
    from selfspec.checkpoint import format_settings, read_meta, read_settings, save_tuned
    from selfspec.evaluation.sweep import write_back_fastest

    model = make_model("llama", tokenizer)
    own = DecodeSettings(exit_layer=2, num_speculations=3)
    ckpt = save_tuned(tmp_path / "tuned", model, tokenizer, settings=own)
    pick = DecodeSettings("ngram", 2, 3)
    entry = {"settings": pick.to_json(), "speedup": 1.6, "low": 1.4, "high": 1.7, "coverage": 0.94,
             "drafter": "ngram", "tokens_per_second": 1.0}
    assert write_back_fastest(str(ckpt), {"best": entry, "fastest_per_drafter": {"ngram": entry},
                                          "confirmed": [entry]}, tmp_path / "sweep.json", "json_schema")
    assert read_settings(ckpt) == own and "sweep" not in read_meta(ckpt)
    assert format_settings(ckpt) == {"json_schema": pick}
    gen = load_tuned(ckpt)
    prompt = prompt_ids(tokenizer)
    constrained = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON)
    assert constrained.stats.early_exit.drafted == 0 and constrained.stats.forced.accepted > 0  # copies
    assert gen.generate([prompt], max_new_tokens=12, eos_token_id=[]).stats.early_exit.drafted > 0
    told = gen.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=own)
    assert told.stats.early_exit.drafted > 0 and told.sequences == constrained.sequences
    assert load_tuned(ckpt, num_speculations=2).format_settings == {}  # a keyword: the caller's setting


def test_the_sweep_command_on_json_extract_writes_back_under_formats_only(tokenizer, tmp_path):
    import json as json_module

    from selfspec.checkpoint import read_meta, read_settings, save_tuned
    from selfspec.cli import main
    from selfspec.evaluation.paired import beats_plain

    own = DecodeSettings(exit_layer=2, num_speculations=3)
    ckpt = save_tuned(tmp_path / "tuned", make_model("llama", tokenizer), tokenizer, settings=own)
    out = tmp_path / "sweep"
    assert main(["eval", "sweep", "--model", str(ckpt), "--prompts", "json-extract", "--num-prompts", "1",
                 "--exit-layers", "2", "--ks", "2", "--drafters", "early_exit,ngram", "--max-new-tokens", "8",
                 "--repeats", "1", "--warmup", "0", "--confirm-repeats", "2", "--write-back",
                 "--out", str(out)]) == 0
    report = json_module.loads((out / "sweep.json").read_text())
    meta = read_meta(ckpt)
    # timing decides whether anything beat plain; either way the free-text defaults stay the checkpoint's
    assert read_settings(ckpt) == own and "sweep" not in meta
    assert ("json_schema" in meta.get("formats", {})) == any(beats_plain(c) for c in report["confirmed"])


def test_constrained_calls_resolve_to_the_formats_stored_settings(tokenizer, tmp_path):
    """The benchmark on json-extract prompts (or under --json-schema) decodes at `formats.json_schema`
    and its per-drafter fastest; free text, or a flag, at the checkpoint's own."""
    from selfspec.checkpoint import resolve_settings, save_tuned, update_meta

    own = DecodeSettings(exit_layer=2, num_speculations=3)
    ckpt = save_tuned(tmp_path / "tuned", make_model("llama", tokenizer), tokenizer, settings=own)
    hybrid = DecodeSettings(drafter="hybrid", exit_layer=1, num_speculations=4, stop_below=0.9)
    early = DecodeSettings(exit_layer=2, num_speculations=2, stop_below=0.9)
    update_meta(ckpt, formats={"json_schema": {"settings": hybrid.to_json(), "fastest": {
        "hybrid": {"settings": hybrid.to_json()}, "early_exit": {"settings": early.to_json()}}}})
    settings, fastest, _ = resolve_settings(ckpt, constraint_kind="json_schema")
    assert settings == hybrid and fastest == {"hybrid": hybrid, "early_exit": early}
    assert resolve_settings(ckpt)[0] == own and resolve_settings(ckpt, constraint_kind="regex")[0] == own
    assert resolve_settings(ckpt, constraint_kind="json_schema", num_speculations=5)[0] == own.override(
        num_speculations=5)


def test_a_grammar_past_the_engines_limits_is_a_user_error(tokenizer):
    """A schema that requires itself nests without end: llguidance stops at its parser's limit while the
    row decodes. The request's doing, so a one-line UserError (the server's 400), not a crash."""
    itself = {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}
    schema = {"$defs": {"a": itself}, "$ref": "#/$defs/a"}
    generator = SelfSpecGenerator(make_model("llama", tokenizer), tokenizer, drafter="ngram")
    with pytest.raises(UserError, match="grew past what the grammar engine can follow"):
        generator.generate([prompt_ids(tokenizer)], max_new_tokens=40, json_schema=schema)


def test_a_constraint_compiled_once_is_kept_unless_it_is_huge(tokenizer):
    """The server compiles a request's grammar as it checks it and the decoding thread reuses it; a huge
    one (a 20,000-value enum compiles to hundreds of MiB) is not kept past its use."""
    from selfspec.decoding.grammar import COMPILED_KEPT_CHARS

    gen = SelfSpecGenerator(make_model("llama", tokenizer), tokenizer, drafter="ngram")
    grammars = gen.grammar_tokenizer()
    small = Constraint.of(PERSON)
    assert grammars.compiled(small) is grammars.compiled(small)
    values = [f"value {i}" for i in range(COMPILED_KEPT_CHARS // 8)]
    huge = Constraint.of({"type": "string", "enum": values})
    assert len(huge.text) > COMPILED_KEPT_CHARS
    assert grammars.compiled(huge) is not grammars.compiled(huge)
