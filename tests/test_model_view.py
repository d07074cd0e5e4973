"""DecoderView equals each family's own forward, piece by piece, with and without a cache."""

import pytest
import torch
from helpers import FAMILIES, tiny_model
from transformers import BertConfig, BertForMaskedLM, DynamicCache

from selfspec.model import DecoderView, UnsupportedArchitectureError

TOL = 1e-5


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pieced_forward_equals_model_forward(family, attn):
    model = tiny_model(family, attn_implementation=attn)
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        view = DecoderView(model)
        hidden = view.embed(ids)
        hidden = view.run_layers(hidden, 0, 2)
        hidden = view.run_layers(hidden, 2, view.num_layers)
        got = view.exit_logits(hidden)
    assert (got - expected).abs().max().item() <= TOL


def test_exit_after_e_layers_is_output_of_block_e_minus_1(family):
    model = tiny_model(family)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    view = DecoderView(model)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # (embeddings, block 0, ..., block N-1)
        assert len(states) == view.num_layers + 1
        for exit_layer in range(1, view.num_layers + 1):
            hidden = view.run_layers(view.embed(ids), 0, exit_layer)
            if exit_layer < view.num_layers:
                reference = states[exit_layer]
            else:  # Hugging Face applies the final norm to the last entry
                hidden = view.final_norm(hidden)
                reference = states[-1]
            assert (hidden - reference).abs().max().item() <= TOL, exit_layer


def test_exit_logits_apply_the_final_norm(family):
    model = tiny_model(family)
    view = DecoderView(model)
    hidden = torch.randn(2, 5, model.config.hidden_size) * 7
    with torch.no_grad():
        expected = view.lm_head(view.final_norm(hidden))
        unnormed = view.lm_head(hidden)
        got = view.exit_logits(hidden)
    # equal up to the summation order (the fast head's products of 2-48 rows run selfspec's kernel)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, unnormed)


def test_incremental_decoding_through_cache_equals_full_forward(family):
    model = tiny_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 18), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache()  # full-attention layers: slot index == position
    with torch.no_grad():
        full = view(ids)
        pieces = [view(ids[:, :7], cache=cache)]  # prefill 7 tokens
        start = 7
        for step in (1, 3, 1, 2, 4):  # then chunks of 1..4 tokens, like drafting and verifying
            chunk = ids[:, start:start + step]
            positions = view.default_positions(chunk, start)
            pieces.append(view(chunk, positions=positions, cache=cache))
            start += step
    assert start == ids.shape[1]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() <= TOL


def test_split_ranges_with_cache_equal_full_forward(family):
    """Layers [0, E) and [E, N) may run in separate calls over one cache (the draft/verify pattern)."""
    model = tiny_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache()
    with torch.no_grad():
        full = view(ids)
        outs = []
        for t in range(ids.shape[1]):
            positions = view.default_positions(ids[:, t:t + 1], t)
            hidden = view.run_layers(view.embed(ids[:, t:t + 1], positions), 0, 2, cache, positions)
            hidden = view.run_layers(hidden, 2, view.num_layers, cache, positions)
            outs.append(view.exit_logits(hidden))
    assert (torch.cat(outs, 1) - full).abs().max().item() <= TOL


def test_rows_at_different_positions_match_rows_run_alone(family):
    """A batch whose rows start at different positions: each row equals its own single-row run."""
    model = tiny_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        batch = view(ids, positions=positions)
        for row in range(2):
            alone = view(ids[row:row + 1], positions=positions[row:row + 1])
            assert (batch[row] - alone[0]).abs().max().item() <= TOL


def test_unwraps_peft_models(family):
    from peft import LoraConfig, get_peft_model

    model = tiny_model(family)
    targets = ["c_attn"] if family == "gpt2" else ["q_proj", "v_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=targets))
    view = DecoderView(peft_model)
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        assert (view(ids) - peft_model(input_ids=ids).logits).abs().max().item() <= TOL


def test_unsupported_architecture_names_the_supported_ones():
    model = BertForMaskedLM(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=16))
    with pytest.raises(UnsupportedArchitectureError, match="bert.*llama, mistral, qwen2, qwen3, gpt2"):
        DecoderView(model)


def test_aligned_rows_share_one_mask_and_one_token_steps_need_none(family):
    """`aligned=True` (all rows at the same positions) must give the same result as per-row masks."""
    model = tiny_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = view(ids)
        for aligned in (False, True):
            cache = DynamicCache()
            outs = [view(ids[:, :5], cache=cache)]
            for t in range(5, 9):
                positions = view.default_positions(ids[:, t:t + 1], t)
                context = view.context(view.embed(ids[:, t:t + 1], positions), positions, t + 1, cached=True,
                                       aligned=aligned)
                if aligned and family != "mistral":  # one token that sees every slot: no mask at all
                    assert all(mask is None for mask in context.masks.values())
                outs.append(view.exit_logits(view.run_layers(view.embed(ids[:, t:t + 1], positions), 0,
                                                             view.num_layers, cache, context=context)))
            assert (torch.cat(outs, 1) - full).abs().max().item() <= TOL
