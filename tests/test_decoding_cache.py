"""KVCache: slice and scatter writes equal the full forward, rollback hides stale keys, lengths are
checked."""

import numpy as np
import pytest
import torch
from helpers import FAMILIES, tiny_model

from selfspec.decoding import CacheLengthError, KVCache
from selfspec.model import DecoderView

TOL = 1e-5



def run(view, cache, ids, starts, start_layer=0, end_layer=None):
    """Feed ids (B, T) at positions starts[b] + 0..T-1 through blocks [start_layer, end_layer)."""
    starts = np.asarray(starts)
    positions = torch.as_tensor(starts)[:, None] + torch.arange(ids.shape[1])
    kv_length = cache.set_positions(positions, starts)
    hidden = view.embed(ids, positions)
    return view.exit_logits(view.run_layers(hidden, start_layer, end_layer or view.num_layers, cache,
                                            positions, kv_length))


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_at_different_positions_with_rollback_equal_the_full_forward(family):
    model = tiny_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = view(ids)  # (2, 16, V)
        cache = KVCache(view.num_layers, batch_size=2, capacity=20)
        wrong = ids[:, :6].clone()
        wrong[1, 3:] = (wrong[1, 3:] + 1) % 96  # row 1 gets wrong tokens at positions 3..5
        run(view, cache, wrong, [0, 0])  # same start: slice writes
        cache.rollback([6, 3])  # row 1 drops its wrong positions; the stale keys stay in the buffer
        got = [[], []]
        starts = np.array([6, 3])
        for length in (1, 3, 2, 4):  # rows at different positions from now on: scatter writes
            chunk = torch.stack([ids[row, starts[row]:starts[row] + length] for row in range(2)])
            logits = run(view, cache, chunk, starts)
            for row in range(2):
                got[row].append(logits[row])
            starts = starts + length
            cache.check(starts)
    for row, start in ((0, 6), (1, 3)):
        assert (torch.cat(got[row]) - full[row, start:start + 10]).abs().max().item() <= TOL


def test_draft_and_verify_ranges_keep_per_layer_lengths():
    model = tiny_model("llama")
    view = DecoderView(model)
    cache = KVCache(view.num_layers, batch_size=1, capacity=10)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        run(view, cache, ids[:, :2], [0])
        assert cache.lengths[:, 0].tolist() == [2, 2, 2, 2]
        run(view, cache, ids[:, 2:3], [2], 0, 2)  # a draft step: blocks [0, 2) only
        assert cache.lengths[:, 0].tolist() == [3, 3, 2, 2]
        with pytest.raises(CacheLengthError, match="layer 2 holds 2 positions"):
            cache.check([3])
        with pytest.raises(CacheLengthError, match="cannot roll layer 2 row 0 forward"):
            cache.rollback([3])
        cache.rollback([2])
        cache.check([2])
    assert cache.get_seq_length() == 2


def test_check_fires_when_a_cache_is_left_one_position_too_long():
    cache = KVCache(num_layers=3, batch_size=2, capacity=8)
    keys = torch.randn(2, 2, 5, 4)
    cache.set_positions(torch.arange(5).expand(2, 5), [0, 0])
    for layer in range(3):
        cache.update(keys, keys, layer)
    cache.rollback([3, 4])
    cache.check([3, 4])
    cache.lengths[1, 0] += 1  # one rejected position left behind in layer 1
    with pytest.raises(CacheLengthError, match="layer 1 holds 4 positions for row 0, but the sequence has 3"):
        cache.check([3, 4])


def test_update_returns_the_announced_slots_and_respects_capacity():
    cache = KVCache(num_layers=1, batch_size=2, capacity=6)
    first = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    assert cache.set_positions(torch.arange(3).expand(2, 3), [0, 0]) == 3
    keys, values = cache.update(first, -first, 0)
    assert torch.equal(keys, first) and torch.equal(values, -first)
    step = torch.full((2, 1, 1, 2), 9.0)
    assert cache.set_positions(torch.tensor([[3], [1]]), [3, 1]) == 4  # scatter: row 1 overwrites slot 1
    keys, _ = cache.update(step, step, 0)
    assert keys.shape == (2, 1, 4, 2)
    assert torch.equal(keys[0, 0, 3], step[0, 0, 0]) and torch.equal(keys[1, 0, 1], step[1, 0, 0])
    assert torch.equal(keys[0, 0, :3], first[0, 0])
    assert cache.lengths[0].tolist() == [4, 2]
    with pytest.raises(ValueError, match="capacity 6"):
        cache.set_positions(torch.arange(4).expand(2, 4) + 3, [3, 3])


def test_select_rows_keeps_the_chosen_rows_buffers_and_lengths():
    cache = KVCache(num_layers=2, batch_size=3, capacity=4)
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 2, 2).contiguous()
    cache.set_positions(torch.tensor([[0, 1], [0, 1], [1, 2]]), [0, 0, 1])
    for layer in range(2):
        cache.update(keys, -keys, layer)
    cache.select_rows([0, 2])
    assert cache.batch_size == 2 and cache.lengths.tolist() == [[2, 3], [2, 3]]
    assert cache.keys[1][:, 0, 1, 0].tolist() == [0.0, 2.0] and cache.values[0][1, 0, 2, 0].item() == -2.0
    cache.check([2, 3])
