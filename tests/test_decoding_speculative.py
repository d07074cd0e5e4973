"""The engine is lossless in greedy mode, handles batches, stops, inputs, and checks its cache."""

import numpy as np
import pytest
import torch
from helpers import FAMILIES, low_alpha_model, reference_greedy, same_tokens, sharp_llama, tiny_model

from selfspec.decoding import CacheLengthError, DecodeSettings, KVCache, SelfSpecGenerator, WindowRule

PROMPTS = [[5, 17, 33, 2, 71, 8], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]  # different lengths
NEW = 14



@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request):
    model = low_alpha_model(request.param)
    return request.param, model, [reference_greedy(model, p, NEW) for p in PROMPTS]


def test_greedy_equals_plain_greedy_for_every_exit_layer_and_k(family_case):
    """k = 0..8 and E = 1..N, a batch of three prompts of different lengths, fp32: token for token."""
    family, model, expected = family_case
    num_layers = model.config.num_hidden_layers
    partial = 0  # rounds that accepted some but not all drafts: the rollback path really ran
    for exit_layer in range(1, num_layers + 1):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer)
        for k in range(0, 9):
            out = generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=k, eos_token_id=[])
            assert out.sequences == expected, (family, exit_layer, k)
            stats = out.stats
            if k and exit_layer == num_layers:  # the draft is the target: every draft is accepted
                assert stats.acceptance_rate == 1.0 and stats.accepted == stats.tested
                assert stats.accepted_histogram[:k] == [0] * k
            if 0 < k:
                partial += sum(stats.accepted_histogram[1:k])
    assert partial > 0


def test_greedy_is_lossless_when_every_product_takes_the_columns_path(family_case):
    """One row on every weight posed as two columns (`fast.linear`, on CPU only for large weights)
    and 2-8 rows as columns: still the plain greedy output, batch 1 and batch 3."""
    from selfspec.model import kernels

    family, model, expected = family_case
    generator = SelfSpecGenerator(model, exit_layer=2)
    with kernels.using(columns_min_bytes_one_row=0):
        for k in (0, 1, 3, 4, 7):
            assert generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=k,
                                      eos_token_id=[]).sequences == expected, (family, k)
            assert generator.generate(PROMPTS[:1], max_new_tokens=NEW, num_speculations=k,
                                      eos_token_id=[]).sequences == expected[:1], (family, k)


def test_an_exit_adapter_changes_the_drafts_but_never_the_output(family_case):
    """The adapter is read by the draft only, so greedy output stays the model's own token for token (for
    sampling it only changes q, which rejection sampling corrects: test_decoding_distribution)."""
    from selfspec.model.exit_adapter import ExitAdapter

    family, model, expected = family_case
    width = model.get_output_embeddings().weight.shape[1]
    torch.manual_seed(7)
    adapter = ExitAdapter(width, 2 * width)
    torch.nn.init.normal_(adapter.down.weight, std=0.5)  # far from the identity
    for exit_layer in (1, 2):
        with_adapter = SelfSpecGenerator(model, exit_layer=exit_layer, exit_adapters={exit_layer: adapter})
        without = SelfSpecGenerator(model, exit_layer=exit_layer)
        out = with_adapter.generate(PROMPTS, max_new_tokens=NEW, num_speculations=3, eos_token_id=[])
        assert out.sequences == expected, (family, exit_layer)
        plain_drafts = without.generate(PROMPTS, max_new_tokens=NEW, num_speculations=3, eos_token_id=[])
        assert out.stats.accepted_histogram != plain_drafts.stats.accepted_histogram  # the drafts did change


def test_an_exit_block_keeps_the_output_and_its_own_cache_holds_every_position(family_case):
    """An attending exit adapter (`ExitBlock`, cache layer N) is read by the draft only: the output stays
    the model's own. Made a copy of the last block at E = N - 1, its drafts are the target's own tokens,
    which every round then accepts: that holds only if its KV cache was written at every position
    (prefill, drafts, the verification's tail, plain steps, copies) and rolled back with the others."""
    from selfspec.model.exit_adapter import ExitBlock

    family, model, expected = family_case
    num_layers = model.config.num_hidden_layers
    exact = ExitBlock.from_model(model, num_layers - 1).eval()
    for drafter in ("early_exit", "hybrid"):
        generator = SelfSpecGenerator(model, exit_layer=num_layers - 1, drafter=drafter,
                                      exit_adapters={num_layers - 1: exact})
        for k in (1, 3, 5):
            for batch in (PROMPTS, PROMPTS[:1]):
                out = generator.generate(batch, max_new_tokens=NEW, num_speculations=k, eos_token_id=[])
                assert out.sequences == expected[:len(batch)], (family, drafter, k)
                assert out.stats.early_exit.acceptance_rate == 1.0, (family, drafter, k)  # copies may miss
    # A stack: copies of the last two blocks at E = N - 2, each with its own cache layer (N, N + 1)
    stack = ExitBlock.from_model(model, [num_layers - 2, num_layers - 1]).eval()
    generator = SelfSpecGenerator(model, exit_layer=num_layers - 2, exit_adapters={num_layers - 2: stack})
    for k in (1, 4):
        out = generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=k, eos_token_id=[])
        assert out.sequences == expected and out.stats.early_exit.acceptance_rate == 1.0, (family, k)
    torch.manual_seed(3)
    noisy = ExitBlock.from_model(model, 0).eval()
    for parameter in noisy.parameters():
        parameter.data.add_(torch.randn_like(parameter) * 0.5)
    for exit_layer in (1, 2):
        with_block = SelfSpecGenerator(model, exit_layer=exit_layer, exit_adapters={exit_layer: noisy})
        out = with_block.generate(PROMPTS, max_new_tokens=NEW, num_speculations=3, eos_token_id=[])
        assert out.sequences == expected, (family, exit_layer)
        plain = with_block.generate(PROMPTS, max_new_tokens=NEW, num_speculations=0, eos_token_id=[])
        assert plain.sequences == expected


def test_stopping_below_eta_is_lossless_and_counted(family_case):
    """η (Kangaroo's rule) cuts rounds short wherever the draft is unsure: before the first draft (the round
    is a plain step), after some drafts, and inside the hybrid's rounds; the output never changes."""
    family, model, expected = family_case
    stopped = {}
    for eta in (0.0, 0.05, 0.3, 0.999):
        for drafter in ("early_exit", "hybrid"):
            generator = SelfSpecGenerator(model, exit_layer=2, num_speculations=4, drafter=drafter,
                                          stop_below=eta)
            for batch in (PROMPTS, [PROMPTS[0]]):
                out = generator.generate(batch, max_new_tokens=NEW, eos_token_id=[])
                assert out.sequences == [expected[PROMPTS.index(p)] for p in batch], (family, eta, drafter)
                stopped[eta] = stopped.get(eta, 0) + out.stats.stopped_below_eta
                if eta == 0.999:  # no draft is that sure: no early-exit draft at all
                    assert out.stats.early_exit.drafted == 0
    assert stopped[0.0] == 0 and stopped[0.999] > 0
    sampled = SelfSpecGenerator(model, exit_layer=2, num_speculations=4, stop_below=0.3).generate(
        PROMPTS, max_new_tokens=NEW, temperature=1.0, seed=5, eos_token_id=[])
    assert [len(row) for row in sampled.sequences] == [NEW] * len(PROMPTS)


def test_eta_stops_rounds_after_some_drafts():
    """A sharp model's draft is sure of some tokens and not of others: rounds end after 1..k-1 drafts."""
    model = sharp_llama()
    prompts = [[5, 17, 33, 2, 11, 8], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    expected = [reference_greedy(model, p, 20) for p in prompts]
    out = SelfSpecGenerator(model, exit_layer=1, num_speculations=4, stop_below=0.5).generate(
        prompts, max_new_tokens=20, eos_token_id=[])
    assert out.sequences == expected
    cut = sum(n for k, n in out.stats.k_rounds.items() if 0 < k < 4)
    assert out.stats.stopped_below_eta > 0 and cut > 0 and out.stats.early_exit.drafted > 0


def test_rows_stop_at_eos_at_different_steps(family_case):
    family, model, expected = family_case
    # two eos ids taken from the rows' own greedy outputs, so rows stop at different steps
    eos = [expected[0][3], expected[2][8]]

    def cut(seq):
        for i, t in enumerate(seq):
            if t in eos:
                return seq[:i + 1]
        return seq

    want = [cut(s) for s in expected]
    assert len({len(s) for s in want}) > 1
    for exit_layer, k in ((1, 3), (3, 5), (model.config.num_hidden_layers, 8), (2, 0)):
        out = SelfSpecGenerator(model, exit_layer=exit_layer).generate(
            PROMPTS, max_new_tokens=NEW, num_speculations=k, eos_token_id=eos)
        assert out.sequences == want, (exit_layer, k)


def test_batch_rows_equal_single_row_runs():
    model = tiny_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    batch = generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=3, eos_token_id=[]).sequences
    for prompt, row in zip(PROMPTS, batch):
        assert generator.generate([prompt], max_new_tokens=NEW, num_speculations=3,
                                  eos_token_id=[]).sequences == [row]


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 5])
def test_a_draft_crossing_the_limit_is_cut(max_new_tokens):
    model = tiny_model("gpt2")  # high α: rounds emit several tokens, so drafts cross the limit
    expected = [reference_greedy(model, p, max_new_tokens) for p in PROMPTS]
    out = SelfSpecGenerator(model, exit_layer=3).generate(PROMPTS, max_new_tokens=max_new_tokens,
                                                          num_speculations=8, eos_token_id=[])
    assert out.sequences == expected
    assert all(len(s) == max_new_tokens for s in out.sequences)


def test_default_eos_is_the_models_own_and_empty_list_disables_it():
    model = tiny_model("qwen2")
    expected = reference_greedy(model, PROMPTS[0], NEW)
    model.generation_config.eos_token_id = expected[4]
    generator = SelfSpecGenerator(model, exit_layer=2)
    stopped = generator.generate(PROMPTS[0], max_new_tokens=NEW, num_speculations=4).sequences[0]
    assert stopped == expected[:expected.index(expected[4]) + 1]
    assert generator.generate(PROMPTS[0], max_new_tokens=NEW, num_speculations=4,
                              eos_token_id=[]).sequences[0] == expected
    as_int = generator.generate(PROMPTS[0], max_new_tokens=NEW, num_speculations=4, eos_token_id=expected[4])
    assert as_int.sequences[0] == stopped


def test_input_forms_agree():
    model = tiny_model("mistral")
    generator = SelfSpecGenerator(model, exit_layer=2, num_speculations=3)
    expected = generator.generate(PROMPTS, max_new_tokens=8, eos_token_id=[]).sequences
    width = max(map(len, PROMPTS))
    for side in ("left", "right"):
        ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(PROMPTS):
            cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
            ids[row, cols], mask[row, cols] = torch.tensor(prompt), 1
        got = generator.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[]).sequences
        assert got == expected, side
    assert generator.generate(PROMPTS[1], max_new_tokens=8, eos_token_id=[]).sequences == [expected[1]]
    assert generator.generate(torch.tensor(PROMPTS[1]), max_new_tokens=8,
                              eos_token_id=[]).sequences == [expected[1]]
    with pytest.raises(ValueError, match="tokenizer"):
        generator.generate("hello")
    with pytest.raises(ValueError, match="at least one token"):
        generator.generate([[1, 2], []])


class CharTokenizer:
    """One token per character (ids 32..95 are printable ASCII), enough for strings and stop strings."""

    eos_token_id = 10

    def __call__(self, text):
        return {"input_ids": [ord(ch) % 96 for ch in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if skip_special_tokens and i == self.eos_token_id else chr(i) if i >= 32 else "?"
                       for i in ids)


def test_string_prompts_and_stop_strings():
    model = tiny_model("llama")
    tokenizer = CharTokenizer()
    generator = SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=4)
    prompt = "Hi there"
    expected = reference_greedy(model, tokenizer(prompt)["input_ids"], NEW)
    out = generator.generate([prompt], max_new_tokens=NEW, eos_token_id=[])
    assert out.sequences == [expected] and out.texts == [tokenizer.decode(expected, skip_special_tokens=True)]
    assert out.finish_reasons == ["length"]
    stop = tokenizer.decode(expected[5:7])  # completed by the 7th generated token
    first = tokenizer.decode(expected).find(stop)
    out = generator.generate(prompt, max_new_tokens=NEW, eos_token_id=[], stop_strings=[stop])
    assert out.sequences == [expected[:first + 2]]  # the token completing the stop string is kept
    assert out.texts == [tokenizer.decode(expected[:first], skip_special_tokens=True)]  # the text is not
    assert out.finish_reasons == ["stop"]


def test_auto_and_window_controllers_are_lossless():
    model = tiny_model("qwen3")
    expected = [reference_greedy(model, p, NEW) for p in PROMPTS]
    for exit_layer in (1, 3, 4):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer)
        for spec in ("auto", "window", WindowRule(k=2, k_min=1, k_max=5)):
            out = generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=spec, eos_token_id=[])
            assert out.sequences == expected, (exit_layer, spec)


def test_rollback_assertion_fires_when_a_cache_is_left_one_position_too_long(monkeypatch):
    model = tiny_model("llama")
    original = KVCache.rollback

    def one_too_long(self, lengths):
        original(self, lengths)
        self.lengths[-1] += 1  # the last layer keeps one rejected position

    generator = SelfSpecGenerator(model, exit_layer=2, num_speculations=3)
    generator.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])  # fine without the bug
    monkeypatch.setattr(KVCache, "rollback", one_too_long)
    with pytest.raises(CacheLengthError, match="layer 3 holds"):
        generator.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])
    generator.check_cache = False  # switched off: no check
    generator.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])


def test_stats_are_consistent():
    model = tiny_model("gpt2")
    out = SelfSpecGenerator(model, exit_layer=2).generate(PROMPTS, max_new_tokens=NEW, num_speculations=4,
                                                          eos_token_id=[])
    s = out.stats
    assert s.generated_tokens == NEW * len(PROMPTS)
    assert s.drafted == 4 * s.row_rounds and s.draft_steps == 4 * s.rounds
    assert sum(s.accepted_histogram) == s.row_rounds
    assert s.accepted == sum(a * n for a, n in enumerate(s.accepted_histogram))
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted / s.row_rounds)
    assert s.position_tested[0] == s.row_rounds
    assert 0 < s.acceptance_rate <= 1 and s.draft_efficiency <= s.acceptance_rate
    assert s.draft_time > 0 and s.verify_time > 0 and s.total_time >= s.draft_time + s.verify_time
    # c = draft step ÷ full step; with no plain round a verification stands for the full step
    assert s.plain_steps == 0
    assert s.draft_cost == pytest.approx((s.draft_time / s.draft_steps) / (s.verify_time / s.rounds))
    assert set(s.as_dict()) >= {"acceptance_rate", "mean_accepted_length", "draft_cost", "accepted_histogram",
                                "per_position_acceptance", "tokens_per_second"}
    plain = SelfSpecGenerator(model, exit_layer=2).generate(PROMPTS, max_new_tokens=NEW, num_speculations=0,
                                                            eos_token_id=[]).stats
    assert plain.rounds == NEW and plain.plain_steps == NEW and plain.drafted == 0
    assert np.isnan(plain.acceptance_rate)


@pytest.mark.parametrize("drafter", ["early_exit", "hybrid"])
def test_a_profiled_call_splits_every_round_into_its_parts_and_keeps_the_output(drafter):
    from selfspec.decoding.profile import PARTS, PASSES, overhead

    model = tiny_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    kwargs = dict(max_new_tokens=NEW, num_speculations=3, drafter=drafter, eos_token_id=[])
    plain = generator.generate(PROMPTS, **kwargs)
    out = generator.generate(PROMPTS, profile=True, **kwargs)
    assert out.sequences == plain.sequences and plain.stats.profile is None
    parts = out.stats.profile
    assert list(parts) == list(PARTS) and all(seconds >= 0 for seconds in parts.values())
    assert parts["draft passes"] > 0 and parts["verification pass"] > 0 and parts["grammar"] == 0
    # the laps cover the rounds and nothing else: within the call, after the prefill
    assert sum(parts.values()) <= out.stats.total_time - out.stats.prefill_time
    assert overhead(parts) == pytest.approx(sum(v for p, v in parts.items() if p not in PASSES))
    assert "profile" in out.stats.as_dict()


def test_rounds_folded_at_the_end_count_what_round_by_round_updates_count():
    from selfspec.decoding.policy import Segment
    from selfspec.decoding.speculative import GenerationStats
    from selfspec.metrics import AcceptanceStats

    rng = np.random.default_rng(0)
    folded, stepped = GenerationStats(), GenerationStats()
    for _ in range(60):
        rows = int(rng.integers(1, 4))
        copy, early = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        segments = [s for s in (Segment("copy", 0, copy), Segment("early_exit", copy, early)) if s.length]
        k = copy + early
        accepted = rng.integers(0, k + 1, rows)
        folded.log_round(segments, accepted, k)
        stepped.update(accepted, k)
        for segment in segments:
            reached, kept = segment.accepted(accepted)
            if reached.any():
                getattr(stepped, segment.source).update(kept, segment.length)
    folded.fold_rounds()
    for name in ("copy", "early_exit", "forced"):  # repr: NaN (nothing tested) equals NaN there
        assert repr(getattr(folded, name).as_dict()) == repr(getattr(stepped, name).as_dict())
    assert repr(AcceptanceStats.as_dict(folded)) == repr(AcceptanceStats.as_dict(stepped))


def test_invalid_arguments():
    model = tiny_model("llama")
    for exit_layer in (0, 5, None):
        with pytest.raises(ValueError, match="exit_layer"):
            SelfSpecGenerator(model, exit_layer=exit_layer)
    generator = SelfSpecGenerator(model, exit_layer=2)
    for kwargs in ({"num_speculations": -1}, {"num_speculations": "fast"}, {"temperature": -1.0},
                   {"top_p": 0.0}, {"seed": [1, 2]}):
        with pytest.raises(ValueError):
            generator.generate(PROMPTS, max_new_tokens=2, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_greedy_is_lossless_and_sampling_matches_cpu():
    """CUDA path: events for timing, device-side sampling. Lossless against plain greedy on the same
    device; against the CPU the same tokens but for rare near-ties that fp32 rounding can flip."""
    model = low_alpha_model("qwen2")
    on_cpu = [reference_greedy(model, p, NEW) for p in PROMPTS]
    cpu = SelfSpecGenerator(model, exit_layer=2).generate(PROMPTS, max_new_tokens=NEW, temperature=0.8,
                                                          num_speculations=3, seed=1, eos_token_id=[])
    model = model.cuda()
    expected = [reference_greedy(model, p, NEW) for p in PROMPTS]
    assert same_tokens(expected, on_cpu) >= 0.9 * NEW * len(PROMPTS), (expected, on_cpu)
    generator = SelfSpecGenerator(model, exit_layer=2)
    for k in (0, 1, 4, "auto"):
        out = generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=k, eos_token_id=[])
        assert out.sequences == expected, (k, out.sequences, expected)
        assert out.stats.verify_time + out.stats.plain_time > 0, k
    sampled = generator.generate(PROMPTS, max_new_tokens=NEW, temperature=0.8, num_speculations=3, seed=1,
                                 eos_token_id=[])
    # the same uniforms on both devices; tiny float differences could flip a near-tie, so mostly equal
    assert same_tokens(sampled.sequences, cpu.sequences) >= 0.9 * NEW * len(PROMPTS), (sampled.sequences,
                                                                                          cpu.sequences)


class RecordingStreamer:
    """Hugging Face's streamer interface, recording what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() > 0
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


def test_streamer_gets_the_prompt_then_each_row_in_order():
    model = tiny_model("llama")
    gen = SelfSpecGenerator(model, exit_layer=2)
    streamer = RecordingStreamer()
    # Row 1 stops at an eos early, so rows finish out of order; the stream stays in row order.
    out = gen.generate(PROMPTS, max_new_tokens=NEW, num_speculations=3, eos_token_id=[], streamer=streamer)
    assert streamer.ended == 1 and streamer.puts[0] == PROMPTS[0]
    assert sum(streamer.puts[1:], []) == sum(out.sequences, [])
    eos = out.sequences[1][2]
    out = gen.generate(PROMPTS, max_new_tokens=NEW, num_speculations=3, eos_token_id=eos,
                       streamer=(streamer := RecordingStreamer()))
    assert sum(streamer.puts[1:], []) == sum(out.sequences, []) and streamer.ended == 1
    assert len(streamer.puts) > 2  # row 0 streamed round by round, not in one piece at the end


def test_transformers_text_streamer_prints_what_generate_returns(tiny_run, capsys):
    from transformers import AutoModelForCausalLM, TextStreamer

    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"]).eval()
    tokenizer = tiny_run["tokenizer"]
    gen = SelfSpecGenerator(model, tokenizer, exit_layer=2)
    out = gen.generate("def f(x):\n", max_new_tokens=12, eos_token_id=[],
                       streamer=TextStreamer(tokenizer, skip_prompt=True))
    assert capsys.readouterr().out.rstrip("\n") == out.texts[0].rstrip("\n")


def test_the_models_positions_bound_prompt_plus_new_tokens():
    model = tiny_model("gpt2")  # a learned position table: a position past it does not exist
    limit = model.config.n_positions
    gen = SelfSpecGenerator(model, exit_layer=2)
    prompt = [1 + i % 90 for i in range(limit - 11)]  # limit - 11 tokens: room for 11 new ones
    with pytest.raises(ValueError, match=f"exceeds the model's {limit} positions; shorten the prompt"):
        gen.generate([prompt], max_new_tokens=12)
    # up to the last position
    out = gen.generate([prompt], max_new_tokens=11, num_speculations=6, eos_token_id=[])
    assert out.sequences[0] == reference_greedy(model, prompt, 11)


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_k_zero_is_plain_decoding_whatever_the_drafter(drafter):
    """`generate(num_speculations=0)` on a generator whose settings copy: plain decoding, no copies."""
    model = tiny_model("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]  # a repeat: copies would have something to copy
    settings = DecodeSettings(drafter=drafter, exit_layer=2, num_speculations=2)
    generator = SelfSpecGenerator(model, settings=settings)
    out = generator.generate([prompt], max_new_tokens=12, eos_token_id=[], num_speculations=0)
    assert out.sequences == [reference_greedy(model, prompt, 12)]
    assert out.stats.drafted == 0 and out.stats.copy.drafted == 0 and out.stats.plain_steps == 12
    copying = generator.generate([prompt], max_new_tokens=12, eos_token_id=[])
    assert copying.stats.copy.drafted > 0  # without k = 0 the same generator copies
