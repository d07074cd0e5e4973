"""The stepped engine (`decoding.engine.Engine`): add, step, cancel. Rows added before the first step
decode together, rows added later join at a round boundary, a cancelled row leaves before the next round
with its tokens so far; every row's tokens equal its prompt decoded alone (greedy, lossless)."""

import pytest
from helpers import low_alpha_model, reference_greedy

from selfspec.decoding import NewRow, SelfSpecGenerator
from selfspec.errors import UserError

PROMPTS = [[5, 17, 33, 2, 71, 8], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.mark.parametrize("drafter", ["early_exit", "hybrid"])
def test_rows_added_joined_and_cancelled_as_generate_decodes_them_alone(drafter):
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, drafter=drafter, num_speculations=3)
    engine = generator.engine(eos_token_id=[])  # the tiny model's eos is a token like any other here
    first = [engine.add(NewRow(p, 12)) for p in PROMPTS[:2]]
    outputs = engine.step()
    assert sorted(o.row for o in outputs) == first and all(o.rounds >= 1 and o.tokens for o in outputs)
    late = engine.add(NewRow(PROMPTS[2], 10))  # joins at the next step
    cancelled = engine.add(NewRow(PROMPTS[0], 30))
    seen = {row: [] for row in range(4)}
    for o in outputs + engine.step():
        seen[o.row] += o.tokens
    assert seen[late] and seen[cancelled]  # both joined and ran a round
    engine.cancel(cancelled)  # it leaves before the next round
    steps = 2
    while not engine.done:
        outputs = engine.step()
        assert cancelled not in [o.row for o in outputs]
        for o in outputs:
            seen[o.row] += o.tokens
        steps += 1
    out = engine.output()
    assert out.sequences[:3] == [reference_greedy(model, p, n) for p, n in zip(PROMPTS, (12, 12, 10))]
    assert [seen[row] for row in range(4)] == out.sequences
    assert out.sequences[cancelled] == reference_greedy(model, PROMPTS[0], 30)[:len(out.sequences[cancelled])]
    assert 0 < len(out.sequences[cancelled]) < 30 and late == 2 and steps > 3
    assert out.finish_reasons == ["length", "length", "length", "cancelled"]


def test_an_eos_ends_a_row_with_reason_stop_and_the_limit_with_length():
    model = low_alpha_model("llama")
    generator = SelfSpecGenerator(model, exit_layer=2, num_speculations=3)
    free = reference_greedy(model, PROMPTS[0], 12)
    eos = free[6]  # the row stops at its first occurrence
    engine = generator.engine(eos_token_id=[eos])
    rows = [engine.add(NewRow(PROMPTS[0], 12)), engine.add(NewRow(PROMPTS[0], free.index(eos)))]
    reasons = {}
    while not engine.done:
        for o in engine.step():
            assert o.finished == (o.finish_reason is not None)
            reasons[o.row] = o.finish_reason
    out = engine.output()
    assert out.sequences == [free[:free.index(eos) + 1], free[:free.index(eos)]]
    assert [reasons[row] for row in rows] == out.finish_reasons == ["stop", "length"]


def test_an_engine_needs_a_request():
    generator = SelfSpecGenerator(low_alpha_model("llama"), exit_layer=2)
    with pytest.raises(UserError, match="at least one request"):
        generator.engine().step()


def test_a_step_runs_without_autograd_on_any_thread_and_bad_requests_are_refused():
    """The server's decoding thread steps the engine itself: no autograd graph may grow through the
    cache there (inference mode is per thread), even over a static passes' pooled cache."""
    import threading

    import torch
    model = low_alpha_model("llama")
    for static in (None, "eager"):
        generator = SelfSpecGenerator(model, exit_layer=2, static_passes=static)
        generator.generate([PROMPTS[0]], max_new_tokens=4)  # leaves its pooled cache (inference tensors)
        seen = []

        def decode(generator=generator, seen=seen):
            engine = generator.engine(eos_token_id=[])
            engine.add(NewRow(PROMPTS[0], 6))
            engine.step()
            seen.append(any(k.requires_grad for k in engine.lane(False).b.cache.keys if k is not None))
            while not engine.done:
                engine.step()
            seen.append(engine.output().sequences == [reference_greedy(model, PROMPTS[0], 6)])
        with torch.enable_grad():
            thread = threading.Thread(target=decode)
            thread.start()
            thread.join()
        assert seen == [False, True], static
    engine = SelfSpecGenerator(model, exit_layer=2).engine()
    for bad in (NewRow([], 4), NewRow([1, 2], 0)):
        with pytest.raises(UserError, match="needs a prompt and max_new_tokens >= 1"):
            engine.add(bad)
