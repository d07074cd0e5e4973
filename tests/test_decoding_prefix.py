"""The prefix cache (`decoding/prefix.py`): a prompt's keys and values are the same bits whether its
leading chunks came from the cache or were computed, alone or in a batch; every drafter's output
with the cache equals plain decoding's; the cache stays within its bytes, least recently used first."""

import numpy as np
import pytest
import torch
from helpers import FAMILIES, low_alpha_model, reference_greedy

from selfspec.decoding import DecodeSettings, SelfSpecGenerator
from selfspec.decoding.prefix import PrefixCache, prefix_cache_of
from selfspec.errors import UserError

SHARED = [5, 17, 33, 2, 71, 8, 40, 3, 11]  # two chunks of 4 and a token
PROMPTS = [SHARED + [60, 61, 62, 1, 2, 3, 4, 9], SHARED + [7, 7, 12, 13], [44, 45] + SHARED]
SETTINGS = {"plain": DecodeSettings(num_speculations=0),
            "early_exit": DecodeSettings(exit_layer=2, num_speculations=3),
            "ngram": DecodeSettings(drafter="ngram"),
            "hybrid": DecodeSettings(drafter="hybrid", exit_layer=1, num_speculations=2)}


def _chunks(cache: PrefixCache, generator, tokens) -> list[torch.Tensor]:
    """The cached keys and values of `tokens`' whole chunks, as one flat list (plain decoding's layout)."""
    layout = cache.layout(generator.model, None, generator.view.num_layers)
    return [t for chunk in cache.match(layout, tokens) for t in (*chunk.keys, *chunk.values)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompts_chunks_are_the_same_bits_hit_or_miss_alone_or_in_a_batch(family):
    _same_bits_hit_or_miss(low_alpha_model(family))


def test_the_same_bits_hit_or_miss_with_mkls_products(kernel_level):
    """MKL's products and torch's attention round by shape: the chunks still see one shape."""
    kernel_level(None)
    _same_bits_hit_or_miss(low_alpha_model("llama"))


def _same_bits_hit_or_miss(model):
    prompt = PROMPTS[0]
    cold = PrefixCache(chunk=4)
    alone = SelfSpecGenerator(model, num_speculations=0, prefix_cache=cold)
    alone.generate([prompt], max_new_tokens=1)
    expected = _chunks(cold, alone, prompt[:-1])
    assert len(expected) == 2 * 2 * model.config.num_hidden_layers * 2  # 4 chunks: K and V per layer

    warm = PrefixCache(chunk=4)
    generator = SelfSpecGenerator(model, num_speculations=0, prefix_cache=warm)
    generator.generate([PROMPTS[1]], max_new_tokens=1)  # caches the shared two chunks
    assert warm.hit_tokens == 0
    generator.generate([PROMPTS[2], prompt], max_new_tokens=1)  # in a batch, its first two chunks hit
    assert warm.hit_tokens == 8
    got = _chunks(warm, generator, prompt[:-1])
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_drafter_decodes_what_plain_decoding_does_with_a_prefix_cache(family):
    model = low_alpha_model(family)
    cache = PrefixCache(chunk=4)
    generator = SelfSpecGenerator(model, exit_layer=2, prefix_cache=cache)
    reference = [reference_greedy(model, p, 12) for p in PROMPTS]
    for name, settings in SETTINGS.items():
        for prompts in ([PROMPTS[0]], PROMPTS):  # alone, and in a batch (rows prefilled one by one)
            out = generator.generate(prompts, max_new_tokens=12, eos_token_id=[], settings=settings)
            assert out.sequences == reference[:len(prompts)], (family, name)
    assert cache.hit_tokens > 0


def test_chunks_widen_to_4c_from_position_4c_and_a_wide_chunk_hits_as_the_same_bits(kernel_level):
    assert PrefixCache(chunk=4).spans(39) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 32), (32, 39)]
    kernel_level(None)  # MKL's products: their rounding depends on the rows of the pass
    model = low_alpha_model("llama")
    long = [(5 * i) % 90 + 1 for i in range(40)]
    cold = SelfSpecGenerator(model, num_speculations=0, prefix_cache=PrefixCache(chunk=4))
    cold.generate([long], max_new_tokens=1)
    warm = SelfSpecGenerator(model, num_speculations=0, prefix_cache=PrefixCache(chunk=4))
    warm.generate([long[:20]], max_new_tokens=1)  # the four narrow chunks
    warm.generate([long], max_new_tokens=1)
    assert warm.prefix_cache.hit_tokens == 16
    expected, got = _chunks(cold.prefix_cache, cold, long[:-1]), _chunks(warm.prefix_cache, warm, long[:-1])
    assert len(got) == len(expected) == 5 * 2 * model.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_cache_keeps_within_its_bytes_dropping_the_least_recently_used_chunk():
    model = low_alpha_model("llama")
    probe = PrefixCache(chunk=4)
    generator = SelfSpecGenerator(model, num_speculations=0, prefix_cache=probe)
    generator.generate([SHARED], max_new_tokens=1)
    per_chunk = probe.bytes // len(probe)

    cache = PrefixCache(chunk=4, max_bytes=3 * per_chunk)
    generator.prefix_cache = cache
    generator.generate([SHARED], max_new_tokens=1)  # chunks a, b
    generator.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=1)  # chunk c: 3 chunks, at the limit
    assert len(cache) == 3 and cache.bytes == 3 * per_chunk
    generator.generate([SHARED], max_new_tokens=1)  # a, b used again: c is now the oldest
    generator.generate([[9, 9, 9, 9, 8]], max_new_tokens=1)  # chunk d drops c
    assert cache.bytes <= cache.max_bytes and len(cache) == 3
    layout = cache.layout(model, None, generator.view.num_layers)
    assert len(cache.match(layout, SHARED)) == 2
    assert cache.match(layout, [1, 2, 3, 4, 5]) == []
    # a parent is never dropped before its child: the longest prefix stays reachable
    generator.generate([[9, 9, 9, 9, 8, 8, 8, 8, 7]], max_new_tokens=1)
    assert len(cache.match(layout, [9, 9, 9, 9, 8, 8, 8, 8])) == 2


def test_a_prompt_decodes_the_same_tokens_with_or_without_a_prefix_cache_on_real_chunks():
    """Chunked prefill changes which passes compute a prompt, not what the model says here: the same
    greedy tokens as the one-pass prefill on a prompt of several chunks."""
    model = low_alpha_model("qwen3")
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 90, 70)]
    plain = SelfSpecGenerator(model, num_speculations=0)
    cached = SelfSpecGenerator(model, num_speculations=0, prefix_cache=PrefixCache())
    assert (cached.generate([prompt], max_new_tokens=16, eos_token_id=[]).sequences
            == plain.generate([prompt], max_new_tokens=16, eos_token_id=[]).sequences)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_exit_blocks_own_cache_layers_load_from_the_prefix_cache_too(family):
    """Drafting behind an exit block (an adapter with a KV cache of its own at cache layer N): its layers
    are chunks of a layout of their own, loaded on a hit, and the output is plain decoding's."""
    from selfspec.model.exit_adapter import ExitBlock

    model = low_alpha_model(family)
    torch.manual_seed(3)
    block = ExitBlock.from_model(model, 0).eval()
    for parameter in block.parameters():  # drafts that differ from the target's now and then
        parameter.data.add_(torch.randn_like(parameter) * 0.3)
    cache = PrefixCache(chunk=4)
    generator = SelfSpecGenerator(model, exit_layer=2, exit_adapters={2: block}, prefix_cache=cache)
    settings = DecodeSettings(exit_layer=2, num_speculations=3)
    reference = [reference_greedy(model, p, 12) for p in PROMPTS]
    for prompts in ([PROMPTS[0]], PROMPTS):  # the second call's first two rows hit
        out = generator.generate(prompts, max_new_tokens=12, eos_token_id=[], settings=settings)
        assert out.sequences == reference[:len(prompts)], family
    layout = cache.layout(model, block, model.config.num_hidden_layers + block.cache_layers)
    assert len(cache.match(layout, SHARED)) == 2 and cache.hit_tokens >= 8
    assert len(cache.match(layout, SHARED)[0].keys) == model.config.num_hidden_layers + block.cache_layers


def test_a_size_in_mib_gives_a_cache_none_or_one_clear_error():
    assert prefix_cache_of(0) is None and prefix_cache_of(3).max_bytes == 3 << 20
    with pytest.raises(UserError, match="--prefix-cache-mb must be 0"):
        prefix_cache_of(-1)
