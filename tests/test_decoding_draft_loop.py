"""The compiled round (`Backend.draft_loop` and `verify_greedy`, `round_kernels.draft_loop` and
`verify_greedy`): a round's greedy early-exit drafts in one call draft exactly what the step-by-step
Python loop drafts, leave the same cache, stop below η at the same step; the verification in one call
accepts what the Python path accepts; the output stays plain greedy's, for every family, batch, k and
drafter (GPT-2 and windows that cut a slot fall back to Python, which the same assertions cover). And
one row's rounds in one call (`Backend.greedy_rounds`) decode and count what those calls do, and what the
Python round does: per round the same draft sources and lengths, drafts, accepted drafts and emitted
tokens."""

import numpy as np
import pytest
import torch
from helpers import FAMILIES, kernels_unavailable, low_alpha_model, reference_greedy, step_joining, tiny_model

import selfspec.backends.cpu_rounds as round_kernels
from selfspec.decoding import CallOptions, DecodeSettings, Engine, NewRow, SamplingParams, SelfSpecGenerator
from selfspec.decoding.runner import Runner
from selfspec.model import fast

NEW = 14
BATCHES = {
    "one": [[5, 17, 33, 2, 71, 8]],
    "aligned": [[5, 17, 33, 2, 71, 8], [40, 3, 9, 9, 1, 60], [11, 12, 13, 14, 15, 16]],  # same lengths
    "ragged": [[5, 17, 33, 2, 71, 8], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19]],
}


def _count(monkeypatch, name: str) -> list:
    """Whether each call of the compiled function `name` ran (its accessor wrapped)."""
    made = getattr(round_kernels, name)()
    if made is None:
        kernels_unavailable()
    calls = []

    def counted(*args):
        out = made(*args)
        calls.append(bool(out))
        return out

    monkeypatch.setattr(round_kernels, name, lambda: counted)
    return calls


@pytest.fixture
def loop_calls(monkeypatch):
    return _count(monkeypatch, "draft_loop")


@pytest.fixture
def step_calls(monkeypatch):
    return _count(monkeypatch, "draft_step")


@pytest.fixture
def verify_calls(monkeypatch):
    return _count(monkeypatch, "verify_greedy")


@pytest.fixture
def rounds_calls(monkeypatch):
    return _count(monkeypatch, "greedy_rounds")


@pytest.fixture
def round_log(monkeypatch):
    """Every round's draft segments (source, start, length), drafts (B, k) and accepted counts (B,), as the
    engine records them whichever path ran the round (`Runner.record`: the fused call's rounds and the
    Python round's)."""
    log = []
    record = Runner.record

    def logged(stats, segments, accepted, draft_time, verify_time, drafts):
        sources = tuple((s.source, s.start, s.length) for s in segments)
        rows = len(np.asarray(accepted))
        joined = (torch.cat([torch.as_tensor(part) for part in drafts], 1) if len(drafts)
                  else torch.empty(rows, 0, dtype=torch.long))
        tokens = tuple(map(tuple, joined.tolist()))
        log.append((sources, tokens, tuple(np.asarray(accepted).tolist())))
        return record(stats, segments, accepted, draft_time, verify_time, drafts)

    monkeypatch.setattr(Runner, "record", staticmethod(logged))
    return log


LEVELS = ("decode", "rounds", "passes")  # one call of many rounds, each round's calls, the Python round


def _at_levels(log: list, run, *args, **kwargs) -> list:
    """`run(*args, **kwargs)` at each of `LEVELS`: [(its output, its rounds' log)]."""
    outs = []
    for level in LEVELS:
        log.clear()
        with fast.kernels_up_to(level):
            outs.append((run(*args, **kwargs), list(log)))
    return outs


def _same_rounds(outs: list, case) -> None:
    """Every level's output, statistics and rounds (sources, lengths, drafts, accepted counts, and so the
    tokens each round emitted) equal to the Python round's (the last)."""
    python, python_rounds = outs[-1]
    for out, rounds in outs[:-1]:
        assert out.sequences == python.sequences, case
        assert _stats(out) == _stats(python), case
        assert rounds == python_rounds, case


def _stats(out) -> tuple:
    s = out.stats
    return (s.accepted_histogram, s.k_rounds, s.draft_steps, s.plain_steps, s.stopped_below_eta,
            s.early_exit.accepted, s.rounds)


def _both(generator, prompts, monkeypatch, **kwargs):
    with fast.kernels_up_to("rounds"):  # each round's calls (`test_one_call_*` covers a call's rounds in one)
        compiled = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], **kwargs)
    with fast.kernels_up_to("passes"):
        python = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], **kwargs)
    return compiled, python


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_loop_drafts_what_the_python_loop_drafts(family, loop_calls, monkeypatch):
    model = low_alpha_model(family)
    expected = {name: [reference_greedy(model, p, NEW) for p in prompts] for name, prompts in BATCHES.items()}
    stopped = 0
    for exit_layer in (1, 3):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer)  # checks the cache after every round
        for k in (1, 3, 7):
            for eta in (0.0, 0.15):
                for name, prompts in BATCHES.items():
                    settings = DecodeSettings(exit_layer=exit_layer, num_speculations=k, stop_below=eta)
                    compiled, python = _both(generator, prompts, monkeypatch, settings=settings)
                    case = (family, exit_layer, k, eta, name)
                    assert compiled.sequences == python.sequences == expected[name], case
                    assert _stats(compiled) == _stats(python), case
                    stopped += compiled.stats.stopped_below_eta
    assert stopped > 0  # η stopped some rounds, in the loop as in Python
    if family == "gpt2":  # GPT-2's blocks are not the Llama family's: the Python loop throughout
        assert not loop_calls
    else:  # Mistral's window of 8 cuts slots past 8: the compiled loop only before that
        assert any(loop_calls)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_step_behind_an_exit_block_drafts_what_the_python_step_drafts(family, step_calls,
                                                                                   monkeypatch):
    """Rounds whose drafts cannot run as one loop (an exit block; a grammar, tests/test_decoding_grammar)
    run each step as one call (`draft_step`: blocks [0, E), the exit block with its own cache layer, the
    head, the argmax, η): the same drafts, stops and cache as the step from Python."""
    from selfspec.model.exit_adapter import ExitBlock

    model = low_alpha_model(family)
    torch.manual_seed(3)
    noisy = ExitBlock.from_model(model, 0).eval()
    for parameter in noisy.parameters():  # drafts that differ from the target's now and then
        parameter.data.add_(torch.randn_like(parameter) * 0.3)
    expected = {name: [reference_greedy(model, p, NEW) for p in prompts] for name, prompts in BATCHES.items()}
    stopped = 0
    for exit_layer in (1, 3):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer, exit_adapters={exit_layer: noisy})
        for k in (1, 4):
            for eta in (0.0, 0.15):
                for drafter in ("early_exit", "hybrid"):
                    for name, prompts in BATCHES.items():
                        settings = DecodeSettings(drafter=drafter, exit_layer=exit_layer, num_speculations=k,
                                                  stop_below=eta)
                        compiled, python = _both(generator, prompts, monkeypatch, settings=settings)
                        case = (family, exit_layer, k, eta, drafter, name)
                        assert compiled.sequences == python.sequences == expected[name], case
                        assert _stats(compiled) == _stats(python), case
                        stopped += compiled.stats.stopped_below_eta
    assert stopped > 0
    assert any(step_calls) == (family != "gpt2")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_the_compiled_verification_accepts_what_python_accepts_for_every_drafter(family, verify_calls,
                                                                                   monkeypatch):
    """Plain steps (a whole-model call), copies (no early-exit pass), the hybrid (copies after
    early-exit drafts: the tail runs from Python first) and the early exit at E = N."""
    model = low_alpha_model(family)
    generator = SelfSpecGenerator(model, exit_layer=2)
    for name, prompts in BATCHES.items():
        expected = [reference_greedy(model, p, NEW) for p in prompts]
        for kwargs in (dict(num_speculations=0), dict(drafter="ngram", num_speculations=3),
                       dict(settings=DecodeSettings(exit_layer=4, num_speculations=2))):
            compiled, python = _both(generator, prompts, monkeypatch, **kwargs)
            assert compiled.sequences == python.sequences == expected, (family, name, kwargs)
            assert _stats(compiled) == _stats(python), (family, name, kwargs)
    assert any(verify_calls) == (family != "gpt2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_at_different_slots_run_the_compiled_round(dtype, loop_calls, verify_calls, monkeypatch):
    """Prompts of different lengths keep their rows at different slots all along (a server's batch):
    the round's calls write each row at its own slots and mask each row's queries to its own
    positions, computing what block-by-block calls with the engine's mask compute."""
    model = low_alpha_model("llama").to(dtype)
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompts = BATCHES["ragged"]
    for kwargs in (dict(num_speculations=3), dict(drafter="hybrid", num_speculations=4),
                   dict(num_speculations=0)):
        compiled = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], **kwargs)
        with fast.kernels_up_to("blocks"):  # block by block, the cache's scatter, the engine's mask
            blocks = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], **kwargs)
        assert compiled.sequences == blocks.sequences, kwargs
        if kwargs.get("drafter") != "hybrid":  # step by step, the hybrid looks for copies after each draft
            assert _stats(compiled) == _stats(blocks), kwargs
        if dtype == torch.float32:
            assert compiled.sequences == [reference_greedy(model, p, NEW) for p in prompts]
    assert loop_calls and all(loop_calls) and verify_calls and all(verify_calls)


def test_a_trimmed_head_and_a_bf16_model_draft_the_same_in_the_loop(loop_calls, monkeypatch):
    model = low_alpha_model("qwen3")  # q/k norms in the blocks
    counts = np.arange(model.config.vocab_size)[::-1].copy()
    generator = SelfSpecGenerator(model, exit_layer=2, token_counts=counts)
    prompts = BATCHES["one"]
    for k in (2, 5):
        settings = DecodeSettings(exit_layer=2, num_speculations=k, draft_vocab_size=40)
        compiled, python = _both(generator, prompts, monkeypatch, settings=settings)
        assert compiled.sequences == python.sequences == [reference_greedy(model, prompts[0], NEW)]
        assert _stats(compiled) == _stats(python)
    assert loop_calls and all(loop_calls)

    loop_calls.clear()
    low = tiny_model("llama", seed=5).to(torch.bfloat16)
    generator = SelfSpecGenerator(low, exit_layer=2)
    plain = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], num_speculations=0)
    compiled, python = _both(generator, prompts, monkeypatch, num_speculations=3)
    assert compiled.sequences == python.sequences == plain.sequences
    assert _stats(compiled) == _stats(python) and loop_calls and all(loop_calls)


def test_the_loop_never_runs_where_a_round_needs_python_between_drafts(loop_calls, monkeypatch):
    """Sampled rows (q and the draft's random numbers) run the sampled loop, not the greedy one; the hybrid
    drafter runs the loop and looks for a copy after it (other drafts than step by step, the same output)."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompts = [[5, 17, 33, 5, 17, 33, 5, 17]]  # repeats: copies to find
    generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], num_speculations=3, temperature=0.8,
                       seed=0)
    assert not loop_calls
    compiled, python = _both(generator, prompts, monkeypatch, num_speculations=3, drafter="hybrid")
    assert compiled.sequences == python.sequences == [reference_greedy(model, prompts[0], NEW)]
    assert loop_calls and compiled.stats.copy.drafted > 0


@pytest.mark.parametrize("sampled", [False, True])
def test_the_loop_in_torch_stops_below_eta_where_the_compiled_loop_does(sampled, round_log):
    """The reference backend drafts with `selfspec.draft_loop` run as written, the CPU kernels with their
    compiled loop: with η on, each round stops at the same step (before the draft no row is sure of), so
    per round the sources, drafts and accepted counts agree, and the output, greedy and sampled."""
    if round_kernels.draft_loop() is None:
        kernels_unavailable()
    model = low_alpha_model("llama")
    sampling = dict(temperature=0.8, top_p=0.95, seed=4) if sampled else {}
    outs = []
    for backend in ("reference", "cpu_kernels"):
        round_log.clear()
        generator = SelfSpecGenerator(model, exit_layer=2, num_speculations=4, stop_below=0.3,
                                      backend=backend)
        out = generator.generate([[5, 17, 33, 2, 71, 8]], max_new_tokens=24, eos_token_id=[], **sampling)
        outs.append((out.sequences, list(round_log), out.stats.stopped_below_eta))
    assert outs[0] == outs[1]
    assert outs[0][2] > 0  # η stopped rounds


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call_runs_a_rows_rounds_and_decodes_and_counts_what_each_rounds_calls_do(family, rounds_calls,
                                                                                       round_log):
    """One row, greedy, a fixed k (0: plain steps): every round in one compiled call, cut at an eos and
    at max_new_tokens inside it, η stopping drafts there, the cache left at the row's length (checked
    after the call), the statistics as round by round. GPT-2 and Mistral's window of 8 (the call would
    pass slot 8) decode round by round."""
    model = low_alpha_model(family)
    prompt = BATCHES["one"][0]
    expected = reference_greedy(model, prompt, NEW)
    eos = expected[5]  # a token the reply reaches: the call stops after its first occurrence
    cut = expected[:expected.index(eos) + 1]
    for exit_layer in (1, 3):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer)  # checks the cache after every call
        for k in (0, 1, 3, 7):
            for eta in (0.0, 0.15):
                settings = DecodeSettings(exit_layer=exit_layer, num_speculations=k, stop_below=eta)
                for eos_ids, new, want in (([], NEW, expected), ([eos], NEW, cut), ([], 4, expected[:4])):
                    outs = _at_levels(round_log, generator.generate, [prompt], max_new_tokens=new,
                                      eos_token_id=eos_ids, settings=settings)
                    case = (family, exit_layer, k, eta, eos_ids, new)
                    assert outs[0][0].sequences == [want], case
                    _same_rounds(outs, case)
    assert any(rounds_calls) == (family in ("llama", "qwen2", "qwen3"))


@pytest.mark.parametrize("drafter", ["early_exit", "hybrid", "ngram"])
def test_settings_without_fused_rounds_run_each_round_from_python(drafter, rounds_calls, round_log):
    """`DecodeSettings(fused=False)`: no compiled call of many rounds, the same tokens as with them, and at a
    fixed k the same rounds (the copy length adapts between calls there, between rounds here)."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompt = [5, 17, 33, 5, 17, 33, 8, 5, 17, 60, 2, 5, 17]
    settings = DecodeSettings(drafter=drafter, exit_layer=2, num_speculations=3)
    outs = []
    for fused in (True, False):
        rounds_calls.clear()
        round_log.clear()
        outs.append((generator.generate([prompt], max_new_tokens=30, eos_token_id=[],
                                        settings=settings.override(fused=fused)), list(round_log)))
        assert any(rounds_calls) == fused
    if drafter == "early_exit":
        _same_rounds(outs, drafter)
    assert outs[0][0].sequences == outs[1][0].sequences == [reference_greedy(model, prompt, 30)]


@pytest.mark.parametrize("threads", [2, 1])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_overlapped_rounds_keep_the_drafts_tokens_and_statistics_of_rounds_one_after_another(family, threads,
                                                                                            rounds_calls,
                                                                                            round_log):
    """`DecodeSettings.overlap`: each round verifies on one thread while the other drafts the next round
    from the exit's guess of the target's next token. Kept only when the target accepted every draft and
    its next token is the guess, those drafts are the ones a fresh draft makes: the same tokens and the
    same statistics and rounds (sources, lengths, acceptances) as rounds one after another and as the
    Python round, for every k, η, drafter, an eos and max_new_tokens inside the call; some rounds use
    drafts made ahead. On one thread the two tasks run in turn."""
    model = low_alpha_model(family)
    prompt = BATCHES["one"][0]
    expected = reference_greedy(model, prompt, NEW)
    eos = expected[5]
    cut = expected[:expected.index(eos) + 1]
    ahead = 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for exit_layer in (1, 3):
            generator = SelfSpecGenerator(model, exit_layer=exit_layer)  # checks the cache after every call
            for drafter in ("early_exit", "hybrid"):
                for k in (1, 3, 7):
                    for eta in (0.0, 0.15):
                        settings = DecodeSettings(drafter=drafter, exit_layer=exit_layer, num_speculations=k,
                                                  stop_below=eta)
                        for eos_ids, new, want in (([], NEW, expected), ([eos], NEW, cut),
                                                   ([], 4, expected[:4])):
                            outs = []
                            for overlap, level in ((True, "decode"), (False, "decode"), (False, "passes")):
                                round_log.clear()
                                with fast.kernels_up_to(level):
                                    outs.append((generator.generate([prompt], max_new_tokens=new,
                                                                    eos_token_id=eos_ids,
                                                                    settings=settings.override(overlap=overlap)),
                                                 list(round_log)))
                            case = (family, exit_layer, drafter, k, eta, eos_ids, new)
                            assert outs[0][0].sequences == [want], case
                            _same_rounds(outs, case)
                            assert outs[1][0].stats.drafted_ahead == 0, case
                            ahead += outs[0][0].stats.drafted_ahead
    finally:
        torch.set_num_threads(before)
    # Mistral's window of 8 would cut the drafts made ahead: its calls run without them
    assert all(rounds_calls) and (ahead > 0) == (family != "mistral")


def test_a_caller_that_watches_rounds_gets_one_round_per_call(rounds_calls):
    """A stepped engine (the server's), a streamer or stop strings see every round: one round per call,
    the same output, each step's outputs telling the round's counts; with `rounds_per_step` a lone row's
    first round runs alone and the rest in calls of that many rounds, the counts summing to the call's
    statistics; a batch of several rows runs round by round (its last row alone in one call)."""
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompt = BATCHES["one"][0]
    want = reference_greedy(model, prompt, 3 * NEW)
    for rounds_per_step in (1, 4):
        rounds_calls.clear()
        out, steps = step_joining(generator, [NewRow(prompt, 3 * NEW)], {}, eos_token_id=[],
                                  settings=generator.settings.override(num_speculations=3),
                                  rounds_per_step=rounds_per_step)
        assert out.sequences == [want]
        seen = [outputs[0] for outputs in steps]
        passes = [o.rounds for o in seen]
        assert len(seen) == len(rounds_calls) and sum(passes) == out.stats.rounds
        assert passes[0] == 1 and max(passes) == rounds_per_step and len(seen) > 2
        assert sum(o.drafted for o in seen) == out.stats.early_exit.drafted
        assert sum(o.accepted for o in seen) == out.stats.early_exit.accepted
    rounds_calls.clear()
    generator.generate([prompt], max_new_tokens=NEW, eos_token_id=[], num_speculations=3)
    assert rounds_calls == [True]  # the whole call in one
    rounds_calls.clear()
    prompts = BATCHES["aligned"]
    batch = generator.generate(prompts, max_new_tokens=NEW, eos_token_id=[], num_speculations=3)
    assert batch.sequences == [reference_greedy(model, p, NEW) for p in prompts]
    assert len(rounds_calls) <= 1  # round by round while rows share the batch; the last one left, in one call


def test_one_call_of_a_bf16_model_with_a_trimmed_head_decodes_what_its_rounds_decode(rounds_calls):
    counts = np.arange(96)[::-1].copy()
    for model in (low_alpha_model("qwen3"), tiny_model("llama", seed=5).to(torch.bfloat16)):
        generator = SelfSpecGenerator(model, exit_layer=2, token_counts=counts)
        prompt = BATCHES["one"][0]
        plain = generator.generate([prompt], max_new_tokens=NEW, eos_token_id=[], num_speculations=0)
        for v in (0, 40):
            settings = DecodeSettings(exit_layer=2, num_speculations=4, draft_vocab_size=v)
            one = generator.generate([prompt], max_new_tokens=NEW, eos_token_id=[], settings=settings)
            with fast.kernels_up_to("rounds"):
                each = generator.generate([prompt], max_new_tokens=NEW, eos_token_id=[], settings=settings)
            assert one.sequences == each.sequences == plain.sequences
            assert _stats(one) == _stats(each)
    assert rounds_calls and all(rounds_calls)


def test_an_adaptive_k_changes_between_calls_and_sees_every_round(rounds_calls):
    """An adaptive controller runs `ADAPT_ROUNDS` rounds a call at its current k, then takes each
    round's counts: here a rule that cycles k through 1, 2, 3 at every call."""
    from selfspec.decoding.controller import Controller
    from selfspec.decoding.engine import ADAPT_ROUNDS

    class Cycling(Controller):
        k_max = 3

        def __init__(self):
            self.calls, self.updates = 0, 0

        def next_k(self):
            self.calls += 1
            return 1 + self.calls % 3

        def update(self, k, accepted, draft_time, verify_time):
            self.updates += 1

    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompt = BATCHES["one"][0]
    controller = Cycling()
    new = 3 * ADAPT_ROUNDS + 24  # more than two calls' rounds: every k of the cycle runs
    out = generator.generate([prompt], max_new_tokens=new, eos_token_id=[], num_speculations=controller)
    assert out.sequences == [reference_greedy(model, prompt, new)]
    assert controller.updates == out.stats.rounds and len(rounds_calls) == controller.calls
    assert len(rounds_calls) == -(-out.stats.rounds // ADAPT_ROUNDS) and len(out.stats.k_rounds) == 3


def test_calls_under_an_adaptive_k_grow_while_it_keeps_its_k_and_start_again_when_it_changes():
    """Calls of `ADAPT_ROUNDS` rounds, twice the last call's (up to `ADAPT_MOST`) while the controller keeps
    asking for the same k, `ADAPT_ROUNDS` again once it changes it: here k = 2 for four calls, then 3."""
    from selfspec.decoding.controller import Controller
    from selfspec.decoding.policy import ADAPT_MOST, ADAPT_ROUNDS

    class Switching(Controller):
        k_max = 3

        def __init__(self):
            self.calls = 0

        def next_k(self):
            self.calls += 1
            return 2 if self.calls <= 4 else 3

        def update(self, k, accepted, draft_time, verify_time):
            pass

    model = tiny_model("llama", max_position_embeddings=1024)
    generator = SelfSpecGenerator(model, exit_layer=2, backend="cpu_kernels")
    asked = []
    rounds = generator.backend.greedy_rounds
    generator.backend.greedy_rounds = lambda *args: asked.append(args[6]) or rounds(*args)
    prompt = BATCHES["one"][0]
    out = generator.generate([prompt], max_new_tokens=400, eos_token_id=[], num_speculations=Switching())
    assert out.sequences == [reference_greedy(model, prompt, 400)]
    spans = [ADAPT_ROUNDS * 2 ** i for i in range(4)]
    assert asked[:6] == [min(span, ADAPT_MOST) for span in spans] + [ADAPT_ROUNDS, 2 * ADAPT_ROUNDS], asked

    class Quiet:  # a streamer: the caller reads every round, one a call
        def put(self, value):
            pass

        def end(self):
            pass

    asked.clear()
    out = generator.generate([prompt], max_new_tokens=40, eos_token_id=[], num_speculations=Switching(),
                             streamer=Quiet())
    assert out.sequences == [reference_greedy(model, prompt, 40)] and asked and set(asked) == {1}, asked


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_the_copy_drafters_rounds_in_one_call_copy_and_accept_what_its_rounds_do(family, rounds_calls,
                                                                                 round_log):
    """The `ngram` drafter's rounds in one call: the same n-gram tables and proposals as `NGramIndex`
    (longest suffix first, around the period), a plain step where nothing matches, cut at an eos and
    at the limit. At a fixed copy length the rounds are the per-round path's one for one; with the
    default window rule the copy length changes between calls of `ADAPT_ROUNDS` rounds or more; a caller that
    watches rounds keeps the copies in Python (the call would rebuild its tables every round)."""
    from selfspec.decoding.controller import FixedK
    from selfspec.decoding.engine import ADAPT_ROUNDS
    from selfspec.decoding.ngram import NGramConfig
    from selfspec.decoding.policy import CopyPolicy

    model = low_alpha_model(family)
    generator = SelfSpecGenerator(model, exit_layer=2)
    prompt = [5, 17, 33, 5, 17, 33, 8, 5, 17, 60, 2, 5, 17]  # repeats: copies to find
    expected = reference_greedy(model, prompt, 40)
    eos = expected[20]

    def run(config, copy_length, eos_ids):
        policy = CopyPolicy(config, FixedK(0), copy_controller=FixedK(copy_length))
        return generator.generate([prompt], max_new_tokens=40, eos_token_id=eos_ids, drafter=policy)

    for config in (NGramConfig(), NGramConfig(max_ngram=1, min_ngram=1, max_copy=6)):
        for copy_length in (1, 3, 7):
            for eos_ids, want in (([], expected), ([eos], expected[:expected.index(eos) + 1])):
                outs = _at_levels(round_log, run, config, copy_length, eos_ids)
                case = (family, config, copy_length, eos_ids)
                assert outs[0][0].sequences == [want], case
                _same_rounds(outs, case)
    assert outs[0][0].stats.copy.drafted > 0
    calls = len(rounds_calls)
    out = generator.generate([prompt], max_new_tokens=40, eos_token_id=[], drafter="ngram")
    assert out.sequences == [expected]
    made = len(rounds_calls) - calls  # calls of ADAPT_ROUNDS or more (twice the last while the length stays)
    assert (1 < made <= -(-out.stats.rounds // ADAPT_ROUNDS)) == (family != "gpt2"), made
    calls = len(rounds_calls)  # a caller that steps each round: the copies run from Python
    copies = generator.settings.override(drafter="ngram")
    watched, _ = step_joining(generator, [NewRow(prompt, 40)], {}, eos_token_id=[], settings=copies)
    assert watched.sequences == [expected]
    assert len(rounds_calls) == calls
    # one that takes several rounds a step: the first round alone, then calls of several
    batched, steps = step_joining(generator, [NewRow(prompt, 40)], {}, eos_token_id=[], settings=copies,
                                  rounds_per_step=ADAPT_ROUNDS)
    assert batched.sequences == [expected]
    assert (len(rounds_calls) - calls == len(steps)) == (family != "gpt2")
    assert sum(outputs[0].drafted for outputs in steps) == batched.stats.copy.drafted


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_the_hybrids_rounds_in_one_call_draft_and_accept_what_its_rounds_do(family, rounds_calls, round_log):
    """The `hybrid` in one call: a copy when the context has one, else the early exit's k drafts, and a
    copy after them when their tokens make one and η did not stop them, that copy through blocks
    [0, E) before the verification of all. At a fixed k and copy length the rounds are the per-round
    calls' and the Python round's one for one (each round's sources and lengths, the same acceptances and
    tokens), for any E, k, η and eos, a trimmed draft head too; every output is plain greedy decoding's."""
    from selfspec.decoding.controller import FixedK
    from selfspec.decoding.ngram import NGramConfig
    from selfspec.decoding.policy import CopyPolicy

    def run(generator, config, k, copy_length, eos_ids):
        policy = CopyPolicy(config, FixedK(k), copy_controller=FixedK(copy_length))
        return generator.generate([prompt], max_new_tokens=40, eos_token_id=eos_ids, drafter=policy)

    model = low_alpha_model(family)
    prompt = [5, 17, 33, 5, 17, 33, 8, 5, 17, 60, 2, 5, 17]
    expected = reference_greedy(model, prompt, 40)
    eos = expected[25]
    seen = set()
    for exit_layer, counts, eta in ((1, None, 0.0), (2, None, 0.05), (3, np.arange(96)[::-1].copy(), 0.0)):
        generator = SelfSpecGenerator(model, exit_layer=exit_layer, token_counts=counts, stop_below=eta,
                                      draft_vocab_size=0 if counts is None else 24)
        for config, k, copy_length in ((NGramConfig(max_ngram=1, min_ngram=1, max_copy=6), 2, 3),
                                       (NGramConfig(), 3, 5), (NGramConfig(max_ngram=2, min_ngram=1), 1, 2)):
            for eos_ids, want in (([], expected), ([eos], expected[:expected.index(eos) + 1])):
                calls = len(rounds_calls)
                outs = _at_levels(round_log, run, generator, config, k, copy_length, eos_ids)
                ran = len(rounds_calls) > calls
                case = (family, exit_layer, eta, config, k, copy_length, eos_ids)
                assert outs[0][0].sequences == [want], case
                _same_rounds(outs, case)
                for source in ("copy", "early_exit"):
                    drafts = [(getattr(o.stats, source).drafted, getattr(o.stats, source).accepted)
                              for o, _ in outs]
                    assert len(set(drafts)) == 1, case
                assert ran == (family != "gpt2"), case
                seen.update(tuple(source for source, _, _ in segments) for segments, _, _ in outs[0][1])
    assert {("copy",), ("early_exit",), ("early_exit", "copy")} <= seen  # every kind of round ran


SAMPLINGS = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(temperature=1.0, top_p=0.9),
             SamplingParams(temperature=0.7)]


def _stepped(generator, prompt, settings, sampling, seed):
    """Each round of a stepped engine (one round a step): (tokens, drafted, accepted) per round."""
    engine = generator.engine(settings, rounds_per_step=1, eos_token_id=[])
    engine.add(NewRow(prompt, NEW, seed=seed, sampling=sampling))
    rounds = []
    while not engine.done:
        rounds += [(out.tokens, out.drafted, out.accepted) for out in engine.step()]
    return rounds


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_sampled_rows_rounds_in_one_call_draw_what_its_rounds_from_python_draw(family, rounds_calls):
    """One sampled row at a fixed k (0: plain steps), η on and off, a trimmed head, overlapped rounds (the
    next round drafted ahead from the exit's guess of the target's draw, kept when the target drew it):
    its rounds in one compiled call (`greedy_rounds` with the row's sampling), round by round in the
    compiled draft loop and verification (`draft_loop_sampled`, `verify_sampled`) and round by round in
    torch operations (`selfspec.sampling`'s rule) draw the same tokens from the same drafts: per round its
    tokens, drafts and accepted drafts, and the call's statistics. GPT-2 runs its rounds from Python
    throughout."""
    model = low_alpha_model(family)
    prompt = BATCHES["one"][0]
    counts = np.arange(96)[::-1].copy()
    generator = SelfSpecGenerator(model, exit_layer=2, token_counts=counts)
    ahead = 0  # rounds whose drafts were made ahead, in the overlapped calls
    cases = [(0, 0.0, 0, False), (1, 0.0, 0, False), (3, 0.0, 0, False), (3, 0.15, 0, False),
             (4, 0.0, 40, False), (1, 0.0, 0, True), (2, 0.0, 40, True)]
    for k, eta, vocab, overlap in cases:
        settings = DecodeSettings(exit_layer=2, num_speculations=k, stop_below=eta, draft_vocab_size=vocab,
                                  overlap=overlap)
        for seed, sampling in enumerate(SAMPLINGS):
            keywords = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            seed=seed, settings=settings, max_new_tokens=NEW, eos_token_id=[])
            outs, rounds = [], []
            for level in ("decode", "rounds", "passes"):  # one call, each round's calls, torch's sampling
                with fast.kernels_up_to(level):
                    outs.append(generator.generate([prompt], **keywords))
                    rounds.append(_stepped(generator, prompt, settings, sampling, seed))
            case = (family, k, eta, vocab, overlap, sampling)
            assert outs[0].sequences == outs[1].sequences == outs[2].sequences, case
            assert _stats(outs[0]) == _stats(outs[1]) == _stats(outs[2]), case
            assert rounds[0] == rounds[1] == rounds[2], case
            assert [t for r in rounds[0] for t in r[0]] == outs[0].sequences[0], case
            ahead += outs[0].stats.drafted_ahead
    assert any(rounds_calls) == (family != "gpt2")
    assert (ahead > 0) == (family != "gpt2")


def test_one_sampled_row_keeps_its_greedy_batch_mates_on_the_compiled_round(monkeypatch):
    """7 greedy rows and 1 sampled one in one `Engine` (`engine()` would give each kind a lane of its own):
    every round's drafts and verification are one compiled call each (`draft_loop_sampled`,
    `verify_sampled`: the greedy rows take their argmax inside them), no round falls back to torch
    operations, and each row decodes what it decodes alone (greedy rows plain greedy's tokens, the sampled
    row its seed's)."""
    loops, verifications = _count(monkeypatch, "draft_loop_sampled"), _count(monkeypatch, "verify_sampled")
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, num_speculations=3)
    prompts = [[5 + i, 17, 33, 2 + i, 71, 8] for i in range(8)]
    sampled = SamplingParams(temperature=0.8, top_p=0.95)
    settings, policy = generator._resolve(None, None, None)
    engine = Engine(generator.runner.for_engine(), policy,
                    CallOptions(settings, SamplingParams(), generator._eos_ids([])))
    for i, prompt in enumerate(prompts):
        engine.add(NewRow(prompt, NEW, seed=i, sampling=sampled if i == 7 else SamplingParams()))
    sampled_rounds = 0  # the rounds the sampled row ran in (the batch greedy after it finishes)
    while not engine.done:
        sampled_rounds += any(out.row == 7 for out in engine.step())
    out = engine.output()
    for i, prompt in enumerate(prompts[:7]):
        assert out.sequences[i] == reference_greedy(model, prompt, NEW), i
    alone = generator.generate([prompts[7]], max_new_tokens=NEW, eos_token_id=[], temperature=0.8, top_p=0.95,
                               seed=7)
    assert out.sequences[7] == alone.sequences[0]
    assert all(loops) and all(verifications)
    assert len(loops) == len(verifications) == sampled_rounds > 1
