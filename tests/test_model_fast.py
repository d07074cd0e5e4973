"""`FastLlamaBlocks` and the rotary table: the autograd-free decode path equals Hugging Face's blocks."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch
from helpers import kernels_unavailable, tiny_model

from selfspec.decoding.cache import KVCache
from selfspec.model import DecoderView
from selfspec.model.fast import FastLlamaBlocks, kernels_up_to, linear

LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def _layer_reference(view, index, hidden, positions):
    """Block `index` through the model's own module (autograd on, so the fast path stays out)."""
    extras = view.adapter.block_extras(hidden, positions)
    mask = view.context(hidden).masks[view.windows[index]]
    with torch.enable_grad():
        return view.layers[index](hidden, attention_mask=mask, **extras).detach()


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_fast_block_equals_the_model_block(family):
    view = DecoderView(tiny_model(family))
    assert view.adapter.fast is not None
    hidden = torch.randn(2, 12, view.config.hidden_size)
    positions = view.default_positions(hidden)
    with torch.no_grad():
        ctx = view.context(hidden)
        for index in range(view.num_layers):
            fast = view.adapter.fast(index, hidden, ctx.masks[view.windows[index]], None,
                                     *ctx.extras["position_embeddings"])
            torch.testing.assert_close(fast, _layer_reference(view, index, hidden, positions),
                                       rtol=1e-5, atol=1e-5)


def test_biases_everywhere_are_applied():
    """Llama with attention and MLP biases (Qwen2 covers q/k/v biases alone)."""
    model = _family_model("llama_biased")
    view = DecoderView(model)
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(view(ids), model(ids).logits, rtol=1e-5, atol=1e-5)


def _decode_through_cache(view, ids, bounds):
    """Logits (B, T, V) of ids run as consecutive chunks [start, end) through one KVCache."""
    cache = KVCache(view.num_layers, ids.shape[0], 32)
    logits = []
    for start, end in bounds:
        positions = view.default_positions(ids[:, start:end], start)
        kv_length = cache.set_positions(positions, [start] * ids.shape[0])
        hidden = view.run_layers(view.embed(ids[:, start:end], positions), 0, view.num_layers, cache=cache,
                                 positions=positions, kv_length=kv_length, aligned=True)
        logits.append(view.exit_logits(hidden))
    return torch.cat(logits, 1)


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_cached_decoding_on_the_fast_path_equals_the_model(family):
    model = tiny_model(family)
    ids = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        logits = _decode_through_cache(DecoderView(model), ids, [(t, t + 1) for t in range(20)])
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_fast_path_only_without_autograd_and_in_eval_mode(monkeypatch):
    view = DecoderView(tiny_model("llama"))
    calls = []
    run_block = FastLlamaBlocks.__call__

    def counting(self, *args):
        calls.append(1)
        return run_block(self, *args)

    monkeypatch.setattr(FastLlamaBlocks, "__call__", counting)
    ids = torch.randint(0, 96, (1, 6))
    view(ids)  # autograd on: the model's own blocks (training needs them)
    assert calls == []
    with torch.no_grad():
        view.model.train()
        view(ids)  # training mode (dropout may be on): the model's own blocks
        assert calls == []
        view.model.eval()
        view(ids)
    assert len(calls) == view.num_layers


def test_unmerged_lora_layers_keep_the_model_blocks():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert DecoderView(model).adapter.fast is None
    assert FastLlamaBlocks.build(DecoderView(model).layers, model.config) is None


def test_gpt2_has_no_fast_path_and_still_runs():
    view = DecoderView(tiny_model("gpt2"))
    assert getattr(view.adapter, "fast", None) is None
    with torch.no_grad():
        ids = torch.randint(0, 96, (1, 6))
        torch.testing.assert_close(view(ids), view.model(ids).logits, rtol=1e-5, atol=1e-5)


def test_rotary_table_rows_equal_per_call_values_and_the_table_grows():
    view = DecoderView(tiny_model("llama", max_position_embeddings=4096))
    hidden = torch.randn(2, 3, view.config.hidden_size)
    positions = torch.tensor([[5, 6, 7], [300, 301, 302]])  # beyond the first table (256 rows)
    cos, sin = view.adapter.block_extras(hidden, positions, max_position=302)["position_embeddings"]
    assert view.adapter._rope_table[0].shape[0] == 512
    ref_cos, ref_sin = view.model.model.rotary_emb(hidden, position_ids=positions)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_length_dependent_rotary_is_computed_per_call():
    model = tiny_model("llama",
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    model = type(model)(model.config).float().eval()
    view = DecoderView(model)
    hidden = torch.randn(1, 2, view.config.hidden_size)
    view.adapter.block_extras(hidden, torch.tensor([[0, 1]]), max_position=1)
    assert view.adapter._rope_table is None


def test_fsdp_wrapped_blocks_keep_their_own_calls():
    """FSDP gathers weights in hooks around a block's call; the fast path would bypass them."""
    model = tiny_model("llama")
    layers = DecoderView(model).layers
    assert FastLlamaBlocks.build(layers, model.config) is not None
    layers[1]._fsdp_wrapped_module = layers[1].mlp  # how FSDP1 marks a wrapped unit
    assert FastLlamaBlocks.build(layers, model.config) is None


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_multi_token_step_on_a_cache_with_a_mask_equals_the_model(family):
    """The verification shape: T > 1 new tokens behind a prefix in the cache (masked GQA attention)."""
    model = tiny_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 14))
    with torch.no_grad():
        logits = _decode_through_cache(view, ids, [(0, 9), (9, 14)])  # prefill, then a 5-token "verification"
        torch.testing.assert_close(logits[:, 9:], model(ids).logits[:, 9:], rtol=1e-5, atol=1e-5)
        hidden = torch.zeros(2, 5, view.config.hidden_size)
        masks = view.context(hidden, view.default_positions(ids[:, 9:], 9), 14, cached=True,
                             aligned=True).masks
        assert all(mask is not None for mask in masks.values())  # the masked attention path ran


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fast_path_in_bfloat16_tracks_the_model(family):
    model = tiny_model(family).to(torch.bfloat16)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        fast, reference = view(ids).float(), model(ids).logits.float()
    assert view.adapter.fast is not None
    # bf16 keeps 8 bits of mantissa: the same ops in the same order stay within a few of its steps.
    torch.testing.assert_close(fast, reference, rtol=2e-2, atol=2e-2)
    assert (fast.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_eager_attention_and_hooked_blocks_keep_the_model_blocks(monkeypatch):
    eager = DecoderView(tiny_model("llama", attn_implementation="eager"))
    assert not eager.adapter.uses_fast()
    model = tiny_model("llama")
    model(torch.randint(0, 96, (1, 4)), output_hidden_states=True)  # transformers' recording hooks are fine
    assert DecoderView(model).adapter.fast is not None
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 2)
    assert DecoderView(model).adapter.fast is None


def test_a_user_hook_is_not_mistaken_for_transformers_recording_hook():
    model = tiny_model("llama")

    def my_output_capture(module, args, out):  # a name like transformers' hook, but not transformers' hook
        return out * 2

    model.model.layers[0].register_forward_hook(my_output_capture)
    assert DecoderView(model).adapter.fast is None


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 3), (2, 2), (1, 5), (2, 4), (1, 9), (3, 40)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("one_row_large", [False, True])
@pytest.mark.parametrize("out_features", [48, 47])
def test_the_columns_linear_equals_f_linear(shape, bias, one_row_large, out_features):
    """`fast.linear` (W @ xᵀ for 2-8 rows on CPU; for one row on a large weight, W's two halves as a
    batch when its height is even, else the row padded with a copy) gives F.linear's values and
    shape for every row count, with and without a bias."""
    from selfspec.model import kernels

    torch.manual_seed(0)
    weight = torch.randn(out_features, 32)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(*shape, 32)
    # one_row_large: this small weight as if it were large enough for one row's own paths
    with kernels.using(columns_min_bytes_one_row=0) if one_row_large else contextlib.nullcontext():
        out = linear(x, weight, b)
    assert out.shape == (*shape, out_features) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def few_rows():
    """selfspec's compiled few-row kernel; these tests skip where it cannot be built (no compiler or
    no AVX2), where `fast.linear` keeps MKL's products."""
    from selfspec.model import kernels

    kernel = kernels.few_rows_linear()
    if kernel is None:
        kernels_unavailable()
    return kernel


@pytest.mark.parametrize("in_features", [1100, 576, 37, 8, 3])
@pytest.mark.parametrize("out_features", [48, 47, 1])
def test_the_few_rows_kernel_equals_f_linear_in_fp32(few_rows, in_features, out_features):
    """Every row count 1-8 (the remainder rows and K's tail included) gives the product within the
    rounding bound of any fp32 summation order, K·eps·Σ|x·w| (what F.linear also meets)."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    for rows in range(1, 9):
        x = torch.randn(rows, in_features)
        out = few_rows(x, weight)
        assert out.shape == (rows, out_features) and out.dtype == torch.float32
        exact = x.double() @ weight.double().t()
        bound = in_features * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().t())
        assert ((out.double() - exact).abs() <= bound).all(), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features", [12, 100, 576, 1100])
def test_a_row_computes_bit_for_bit_the_same_alone_or_among_others_in_the_kernel(few_rows, dtype,
                                                                                 in_features):
    """What makes a verification compute what single steps compute: a row's result does not depend on
    how many rows share the call (more than 8 in groups of up to 4 against pairs of W rows, an odd W
    row alone; 2-8 with K >= 1024, fp32 or bf16, a chunk of K at a time, tiles of W rows cut by the
    threads' split), nor on how the threads split the weight's rows."""
    torch.manual_seed(0)
    weight = torch.randn(1001, in_features).to(dtype)
    x = torch.randn(8, in_features).to(dtype)
    alone = torch.cat([few_rows(x[i:i + 1], weight) for i in range(8)])
    for rows in range(2, 9):
        assert torch.equal(few_rows(x[:rows], weight), alone[:rows]), rows
    for extra in (1, 2, 3, 5):  # 17-21 rows: groups of 4 and what is left (1, 2, 3 or 4 + 1)
        many = torch.cat([x, x.flip(0), x[:extra]])
        assert torch.equal(few_rows(many, weight), torch.cat([alone, alone.flip(0), alone[:extra]])), extra
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(few_rows(x, weight), alone)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_greedy_target_under_masks_reads_only_the_allowed_rows_of_narrow_masks(few_rows, dtype, bias):
    """`masked_target` (the compiled verification's head under a grammar) gives the argmax of the
    masked logits of the whole head, for masks that allow one token (forced), a few, exactly V / 8 (the
    widest computed alone), one more (the whole head), all, tokens that tie (the first wins) and
    tokens whose logits are all -inf (the first allowed, as `apply_mask` makes the row uniform)."""
    from selfspec.model import kernels
    from selfspec.sampling import apply_mask

    torch.manual_seed(0)
    vocab, width = 512, 37
    head = torch.randn(vocab, width)
    head[7] = head[300]  # tokens 7 and 300 tie wherever both are allowed
    head[400:410] = float("-inf")
    head, norm = head.to(dtype), torch.randn(width).to(dtype)
    b = torch.randn(vocab) if bias else None
    if b is not None:
        b[300] = b[7]
        b = b.to(dtype)
    h = torch.randn(8, width).to(dtype)
    allowed = torch.zeros(8, vocab, dtype=torch.bool)
    allowed[0, 5] = True
    allowed[1, [3, 90, 200]] = True
    allowed[2, torch.randperm(vocab)[:vocab // 8]] = True
    allowed[3, torch.randperm(vocab)[:vocab // 8 + 1]] = True
    allowed[4] = True
    allowed[5, [7, 300]] = True
    allowed[6, 400:410] = True
    allowed[7, [7, 300, 1, 2]] = True
    x = h.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    logits = few_rows((norm * x.to(dtype)).contiguous(), head)
    if b is not None:
        logits = logits + b
    expected = apply_mask(logits, allowed).float().argmax(-1)
    target = kernels.extension().Head(norm=norm, eps=1e-5, weight=head, bias=b, vocab=vocab)
    got = kernels.extension().masked_target(h, target, allowed)
    assert torch.equal(got, expected)
    assert got[5] == 7 and got[6] == 400


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("trimmed", [False, True])
def test_the_draft_choice_is_the_argmax_of_the_draft_heads_masked_logits(few_rows, dtype, bias, trimmed):
    """`draft_choice` (the compiled draft loop's and step's head: final norm, head, mask, argmax in one
    pass) picks what `DraftHead.logits` + `apply_mask` + argmax pick, ties by the lower token id even
    where a trimmed head lists the higher first; a mask whose tokens all lie outside the trimmed ids
    gives the first allowed (`apply_mask`'s uniform row); `top` is the softmax's top probability (η's)."""
    from selfspec.backends import cpu_rounds as round_kernels
    from selfspec.sampling import apply_mask

    torch.manual_seed(0)
    vocab, width, rows = 512, 37, 8
    head = torch.randn(vocab, width) * 3
    head[300] = head[7]  # tokens 7 and 300 tie wherever both are allowed
    ids = torch.randperm(vocab)[:200] if trimmed else None
    if trimmed:  # the tied pair inside, the higher id listed first; token 450 outside
        ids = torch.cat([torch.tensor([300, 7]), ids[(ids != 300) & (ids != 7) & (ids != 450)]])
    norm, h = torch.randn(width).to(dtype), torch.randn(rows, width).to(dtype)
    full_bias = torch.randn(vocab) if bias else None
    if full_bias is not None:
        full_bias[300] = full_bias[7]
        full_bias = full_bias.to(dtype)
    weight = (head[ids] if trimmed else head).to(dtype).contiguous()
    b = None if full_bias is None else (full_bias[ids] if trimmed else full_bias).contiguous()

    def head_at(stop_below):  # the draft head as the compiled calls take it, with η
        return round_kernels.state_types()[1](norm=norm, eps=1e-5, weight=weight, bias=b, ids=ids,
                                              vocab=vocab, stop_below=stop_below)

    allowed = torch.ones(rows, vocab, dtype=torch.bool)
    allowed[1] = False
    allowed[1, [7, 300]] = True  # a tie
    allowed[2] = False
    allowed[2, 450] = True  # outside a trimmed head: nothing finite
    allowed[3, torch.randperm(vocab)[:vocab // 2]] = False
    for mask in (None, allowed):
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        sub = (norm * x.to(dtype)) @ weight.T
        if b is not None:
            sub = sub + b
        logits = sub
        if trimmed:
            logits = torch.full((rows, vocab), float("-inf"), dtype=dtype).index_copy_(-1, ids, sub)
        if mask is not None:
            logits = apply_mask(logits, mask)
        logits = logits.float()
        got, top = round_kernels.draft_choice()(h, head_at(0.5), mask)
        expected = logits.argmax(-1)
        # the norm's sum runs in another order than torch's, which only a near-tie could tell (none here)
        assert torch.equal(got, expected), (got, expected)
        torch.testing.assert_close(top, torch.softmax(logits, -1).max(-1).values, rtol=1e-5, atol=0)
        if mask is not None:
            assert got[1] == 7 and got[2] == 450
            if trimmed:
                assert top[2] == 1.0  # one allowed token
    choose = round_kernels.draft_choice()
    none, zeros = choose(h, head_at(0.0), None)
    assert torch.equal(none, choose(h, head_at(0.5), None)[0])
    assert not zeros.any()  # eta 0: no probabilities computed


@pytest.mark.parametrize("in_features", [576, 37])
def test_the_kernel_in_bf16_is_the_fp32_product_of_the_bf16_values_rounded_once(few_rows, in_features):
    """bf16 weights widen exactly to fp32 and accumulate in fp32: the result is the fp32 product of
    the same values (K's tail included), rounded to bf16 once."""
    torch.manual_seed(0)
    weight, x = torch.randn(300, in_features).bfloat16(), torch.randn(5, in_features).bfloat16()
    out = few_rows(x, weight)
    reference = torch.nn.functional.linear(x.float(), weight.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.bfloat16().float(), rtol=1e-2, atol=1e-3)
    # at most one ulp off where fp32 sums in another order round the other way
    assert (out.float() == reference.bfloat16().float()).float().mean() > 0.95


def test_fast_linear_runs_the_kernel_for_few_rows_and_mkl_otherwise(few_rows, monkeypatch):
    """1-48 fp32 rows (a decode step, a verification, a copy's 11 positions, a short prefill) go through
    the kernel, bias added after; more keep F.linear; `kernels_up_to(None)` restores MKL's paths for A/B
    runs."""
    calls = []
    monkeypatch.setattr("selfspec.model.kernels.few_rows_linear",
                        lambda: lambda x, w: calls.append(x.shape[0]) or few_rows(x, w))
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 32), torch.randn(64)
    for shape in [(1, 1, 32), (1, 5, 32), (2, 4, 32), (1, 11, 32), (2, 24, 32), (1, 49, 32)]:
        x = torch.randn(shape)
        torch.testing.assert_close(linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    assert calls == [1, 5, 8, 11, 48]
    with kernels_up_to(None):
        linear(torch.randn(1, 1, 32), weight, bias)
    assert calls == [1, 5, 8, 11, 48]


def test_a_bf16_prefill_on_a_cpu_that_emulates_bf16_avoids_torchs_bf16_product(few_rows, monkeypatch):
    """Where oneDNN has no bf16 arithmetic (`_emulated_bf16`), 9 to 31 bf16 rows go through the kernel
    (each row as it computes alone) and from 32 rows the product runs in fp32 on the widened values,
    rounded once; with bf16 arithmetic (AVX-512 BF16, AMX) both keep torch's bf16 product."""
    from selfspec.model import kernels

    calls = []
    monkeypatch.setattr("selfspec.model.kernels.few_rows_linear",
                        lambda: lambda x, w: calls.append(x.shape[0]) or few_rows(x, w))
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 40).bfloat16(), torch.randn(48).bfloat16()
    x = torch.randn(1, 40, 40).bfloat16()
    widened = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).bfloat16()
    with kernels.using(emulated_bf16=True):
        assert torch.equal(linear(x, weight, bias), widened) and calls == []
        few = linear(x[:, :20], weight, None)
    assert calls == [20]
    assert torch.equal(few, torch.cat([few_rows(row, weight) for row in x[0, :20, None]])[None])
    calls.clear()
    with kernels.using(emulated_bf16=False):
        torch.testing.assert_close(linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
        linear(x[:, :20], weight, None)
    assert calls == []


@pytest.fixture
def fresh_kernel_lookup():
    """selfspec's compiled kernels looked up anew in the test, and again by the tests after it."""
    from selfspec.model import kernels

    kernels.look_again()
    yield kernels
    kernels.look_again()


def test_the_kernel_is_off_on_request_and_a_failed_build_falls_back_with_a_warning(fresh_kernel_lookup,
                                                                                 monkeypatch):
    kernels = fresh_kernel_lookup
    for off in ("0", "off", "False"):
        monkeypatch.setenv("SELFSPEC_KERNELS", off)
        assert kernels.few_rows_linear() is None
        kernels.look_again()
    monkeypatch.delenv("SELFSPEC_KERNELS")
    monkeypatch.setattr(kernels, "cpu_has_avx2_fma", lambda: True)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)

    def broken(**_):
        raise RuntimeError("Error building extension 'selfspec_kernels'\nthe compiler's output")

    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    with pytest.warns(UserWarning, match="did not build.*uses MKL's products"):
        assert kernels.few_rows_linear() is None
    x, weight = torch.randn(1, 1, 32), torch.randn(48, 32)
    torch.testing.assert_close(linear(x, weight, None), torch.nn.functional.linear(x, weight))


def test_the_kernels_build_with_the_ninja_package_where_none_is_on_path_and_say_when_they_cannot(
        fresh_kernel_lookup, monkeypatch, tmp_path):
    """ninja is a dependency: a process whose PATH lacks it (a venv's python run without activating the
    venv) finds the package's and puts it on PATH for torch's build; with neither, a warning says the
    decode runs on torch's operations instead of falling back in silence."""
    import ninja

    kernels = fresh_kernel_lookup
    monkeypatch.setenv("PATH", str(tmp_path))
    assert kernels.ninja_path() is not None and os.environ["PATH"].startswith(ninja.BIN_DIR)
    monkeypatch.delenv("SELFSPEC_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "cpu_has_avx2_fma", lambda: True)
    monkeypatch.setattr(kernels, "ninja_path", lambda: None)
    with pytest.warns(UserWarning, match="need a C[+][+] compiler .* and ninja"):
        assert kernels.few_rows_linear() is None


def test_a_lock_left_by_a_killed_build_is_removed_before_building(fresh_kernel_lookup, monkeypatch, tmp_path):
    """torch waits forever on its build lock; selfspec builds under a lock of its own (released by the
    OS when a process dies), and any lock of torch's found while holding it is stale: removed."""
    kernels = fresh_kernel_lookup
    build = tmp_path / "py3_cpu" / "selfspec_kernels"
    build.mkdir(parents=True)
    (build / "lock").touch()
    monkeypatch.delenv("SELFSPEC_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "cpu_has_avx2_fma", lambda: True)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr("torch.utils.cpp_extension.get_default_build_root", lambda: str(tmp_path))
    seen = []
    built = type("Module", (), {"few_rows_linear": 1, "few_queries_attention": 2})
    monkeypatch.setattr("torch.utils.cpp_extension.load",
                        lambda **_: seen.append((build / "lock").exists()) or built)
    assert kernels.few_rows_linear() == 1 and seen == [False]


def test_fast_linear_keeps_f_linears_behaviour_where_the_kernel_does_not_apply(few_rows):
    """No rows, autograd (the kernel has no backward) and a bias of another dtype take F.linear."""
    weight, bias = torch.randn(16, 32), torch.randn(16)
    empty = linear(torch.randn(0, 32), weight, bias)
    assert empty.shape == (0, 16)
    x = torch.randn(1, 32, requires_grad=True)
    linear(x, weight, bias).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0, keepdim=True))
    with pytest.raises(RuntimeError):  # F.linear refuses a bf16 input with an fp32 bias; so does linear
        linear(torch.randn(1, 32).bfloat16(), weight.bfloat16(), bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 72, 128])
def test_the_few_queries_attention_kernel_equals_the_padded_attention_and_each_query_is_alone(few_rows,
                                                                                             dtype, head_dim):
    """Grouped-query heads, keys hidden by -inf and by the dtype's min, keys and values sliced from a
    longer cache, head dims below, at and past the kernel's 64 dims in registers: the padded float32
    attention's values, and every query's result bit for bit the same alone as among the others."""
    from selfspec.model import kernels
    from selfspec.model.fast import fixed_attention

    attend = kernels.few_queries_attention()
    block = type("Block", (), {"gqa": True, "scaling": 0.125})
    torch.manual_seed(0)
    q = torch.randn(2, 6, 3, head_dim).to(dtype)
    k, v = (torch.randn(2, 2, 40, head_dim).to(dtype)[:, :, :30] for _ in range(2))  # (B, Hkv, S, hd) views
    mask = torch.zeros(2, 1, 3, 30)
    mask[0, :, :, 25:] = float("-inf")
    mask[1, :, 2, :5] = torch.finfo(torch.float32).min
    flat = mask.reshape(2, 3, 30)
    out = attend(q.float().contiguous(), k, v, flat, 0.125)  # (B, m, H·hd)
    assert out.shape == (2, 3, 6 * head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), fixed_attention(q, k, v, mask, block, 16).float(),
                               rtol=1e-5, atol=1e-5)
    alone = torch.cat([attend(q[:, :, i:i + 1].float().contiguous(), k, v, flat[:, i:i + 1].contiguous(),
                              0.125) for i in range(3)], 1)
    assert torch.equal(alone, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [12, 32, 64])
@pytest.mark.parametrize("heads", [2, 3])
def test_the_attention_kernel_gives_each_head_and_query_its_own_bits_over_many_tiles(few_rows, dtype,
                                                                                   head_dim, heads):
    """A long cache (several tiles of keys, whatever the head's width), heads that share a kv head two
    at a time and one alone (an odd group), the causal queries of a verification (each sees one key
    more than the last): every (head, query) bit for bit what it is alone with its own kv head, and
    the padded float32 attention's values."""
    from selfspec.model import kernels
    from selfspec.model.fast import fixed_attention

    attend = kernels.few_queries_attention()
    torch.manual_seed(0)
    q = torch.randn(1, 2 * heads, 3, head_dim).to(dtype).float()
    k, v = (torch.randn(1, 2, 1100, head_dim).to(dtype)[:, :, :1029] for _ in range(2))
    mask = torch.zeros(1, 3, 1029)
    for i in range(3):
        mask[0, i, 1027 + i:] = float("-inf")  # query i sees keys up to 1026 + i
    out = attend(q, k, v, mask, head_dim ** -0.5)
    for h in range(2 * heads):
        for i in range(3):
            alone = attend(q[:, h:h + 1, i:i + 1].contiguous(), k[:, h // heads:h // heads + 1],
                           v[:, h // heads:h // heads + 1], mask[:, i:i + 1].contiguous(), head_dim ** -0.5)
            assert torch.equal(alone[0, 0], out[0, i, h * head_dim:(h + 1) * head_dim]), (h, i)
    block = type("Block", (), {"gqa": True, "scaling": head_dim ** -0.5})
    padded = fixed_attention(q.to(dtype), k, v, mask[:, None], block, 16)
    torch.testing.assert_close(out.float(), padded.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_hidden_after_a_querys_own_change_nothing_in_the_attention_kernel(few_rows, dtype):
    """A verification's query t sees keys up to its own position and the later ones hidden; the
    single step at t has no later keys at all. Bit for bit the same for every count of hidden keys,
    those that fill a lane group of 8 and those that start a new one (the softmax runs in 8 lanes)."""
    from selfspec.model import kernels

    attend = kernels.few_queries_attention()
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 64)
    k, v = (torch.randn(1, 2, 40, 64).to(dtype) for _ in range(2))
    for seen in (13, 16, 17):
        alone = attend(q, k[:, :, :seen], v[:, :, :seen], torch.zeros(1, 1, seen), 0.125)
        for total in (seen + 1, seen + 3, seen + 11, 40):
            mask = torch.zeros(1, 1, total)
            mask[..., seen:] = float("-inf")
            assert torch.equal(attend(q, k[:, :, :total], v[:, :, :total], mask, 0.125), alone), (seen, total)


def test_the_attention_kernels_exp_follows_expf_and_hides_what_it_should(few_rows):
    """The softmax's vectorized exp against torch's on one query and one key at a time (scores from
    -87 to 88 and beyond): within 2 ulp, exactly 0 for the hidden."""
    from selfspec.model import kernels

    attend = kernels.few_queries_attention()
    scores = torch.cat([torch.linspace(-87.0, 0.0, 4001), torch.tensor([-87.5, -1e4, float("-inf")])])
    # two keys: a first with score 0 (the max) and value 0, a second with the score under test and
    # value 1, so the output is e^s / (1 + e^s)
    q = torch.ones(1, 1, 1, 8)
    k = torch.zeros(1, 1, 2, 8)
    v = torch.tensor([0.0, 1.0]).repeat_interleave(8).reshape(1, 1, 2, 8)
    mask = torch.stack([torch.zeros_like(scores), scores], -1)[:, None]  # (N, 1, 2)
    out = torch.stack([attend(q, k, v, row[None], 1.0)[0, 0, 0] for row in mask])
    expected = torch.exp(scores.double()) / (1 + torch.exp(scores.double()))
    assert (out[-3:] == 0).all()
    torch.testing.assert_close(out[:-3].double(), expected[:-3], rtol=4 * 2**-23, atol=0)


def _family_model(family):
    """`tiny_model(family)`; "llama_biased": Llama with attention and MLP biases, weights drawn wide."""
    if family != "llama_biased":
        return tiny_model(family)
    model = tiny_model("llama", attention_bias=True, mlp_bias=True)
    model = type(model)(model.config).float().eval()  # rebuilt so the biased layers exist
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.fixture
def block_calls(few_rows, monkeypatch):
    """Counts the rows of every call of the compiled block halves (front, back), run block by block
    (the one-call pass, built on the same halves, off: see the pass's own tests)."""
    from selfspec.model import fast, kernels

    front, back = kernels.block_halves()
    calls = []
    monkeypatch.setattr(kernels, "block_halves", lambda: (
        lambda hidden, *rest: calls.append(("front", hidden.shape[1])) or front(hidden, *rest),
        lambda hidden, *rest: calls.append(("back", hidden.shape[1])) or back(hidden, *rest)))
    with fast.kernels_up_to("blocks"):
        yield calls


@pytest.mark.parametrize("family", [*LLAMA_FAMILIES, "llama_biased"])
@pytest.mark.parametrize("large_blocks", [False, True])
def test_a_decoding_pass_runs_each_block_as_the_two_compiled_halves_and_equals_the_model(
        family, large_blocks, block_calls):
    """One-token steps (no mask) and a masked 4-token verification of two rows (8 positions) behind a
    prefix go through the block kernels, every block once per pass. A prefill of two 25-token rows (50
    positions, past `_KERNEL_MAX_ROWS`) does too where the blocks are small
    (`KernelSettings.small_block_bytes`), and keeps the tensor path where they are not. Qwen2 brings
    q/k/v biases, Qwen3 per-head q/k norms, Mistral and Qwen2 grouped-query heads and windows."""
    from selfspec.model import kernels

    model = _family_model(family)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 31))
    with torch.no_grad(), kernels.using(small_block_bytes=0) if large_blocks else contextlib.nullcontext():
        logits = _decode_through_cache(view, ids, [(0, 25), (25, 29), (29, 30), (30, 31)])
        torch.testing.assert_close(logits[:, 25:], model(ids).logits[:, 25:], rtol=1e-5, atol=1e-5)
    layers = view.num_layers
    lengths = (4, 1, 1) if large_blocks else (25, 4, 1, 1)
    assert block_calls == [(half, t) for t in lengths for _ in range(layers) for half in ("front", "back")]


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_kernels_compute_a_position_bit_for_bit_alike_alone_or_in_a_verification(dtype, family,
                                                                                           block_calls):
    """Four positions in one masked pass and the same four as single steps, through the block kernels:
    the same hidden states and cache entries to the bit, in fp32 and bf16 (the products, norms and
    attention of each position never share a reduction with another position)."""
    from selfspec.model import fast

    model = tiny_model(family).to(dtype)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (1, 12))

    def run(bounds):
        cache = KVCache(view.num_layers, 1, 32)
        out = []
        with torch.no_grad(), fast.fixed_width(dtype != torch.float32):
            for start, end in bounds:
                positions = view.default_positions(ids[:, start:end], start)
                kv_length = cache.set_positions(positions, [start])
                hidden = view.embed(ids[:, start:end], positions)
                out.append(view.run_layers(hidden, 0, view.num_layers, cache, positions, kv_length=kv_length,
                                           aligned=True))
        return torch.cat(out, 1)[:, 8:], cache.keys[-1][:, :, 8:12], cache.values[-1][:, :, 8:12]

    together = run([(0, 8), (8, 12)])
    alone = run([(0, 8), (8, 9), (9, 10), (10, 11), (11, 12)])
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert {4, 1} <= {t for half, t in block_calls if half == "front"}  # the kernels ran both ways


@pytest.fixture
def pass_calls(few_rows, monkeypatch):
    """Counts the (blocks, rows) of every call of the compiled pass (`kernels.blocks_pass`)."""
    from selfspec.model import kernels

    block, run = kernels.blocks_pass()
    calls = []
    monkeypatch.setattr(kernels, "blocks_pass", lambda: (block, lambda blocks, hidden, *rest: calls.append(
        (len(blocks), hidden.shape[0] * hidden.shape[1])) or run(blocks, hidden, *rest)))
    return calls


def _decode_with_caches(view, ids, bounds, layers=None):
    """`_decode_through_cache` over blocks [0, N) in the given ranges (e.g. [(0, 2), (2, N)], as the
    engine's drafts and verifications split them): the logits and the cache."""
    cache = KVCache(view.num_layers, ids.shape[0], 32)
    logits = []
    for start, end in bounds:
        positions = view.default_positions(ids[:, start:end], start)
        kv_length = cache.set_positions(positions, [start] * ids.shape[0])
        hidden = view.embed(ids[:, start:end], positions)
        context = view.context(hidden, positions, kv_length, cached=True, aligned=True)
        for first, last in layers or [(0, view.num_layers)]:
            hidden = view.run_layers(hidden, first, last, cache, context=context)
        logits.append(view.exit_logits(hidden))
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("family", [*LLAMA_FAMILIES, "llama_biased"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_pass_runs_its_blocks_in_one_call_bit_for_bit_as_block_by_block(family, dtype, pass_calls,
                                                                                   monkeypatch):
    """Blocks [0, 2) and [2, N) of masked 4- and 11-token verifications of two rows (a copy of 10
    tokens verifies 11) and of one-token steps, each range in one compiled call: the logits, every
    layer's keys and values and the cache's lengths the same to the bit as block by block, in fp32 and
    bf16 (the prefill, before the cache has buffers, runs block by block)."""
    from selfspec.model import fast

    model = _family_model(family)
    model = model.to(dtype)
    ids = torch.randint(0, 96, (2, 26))
    bounds, layers = [(0, 9), (9, 13), (13, 24), (24, 25), (25, 26)], [(0, 2), (2, 4)]
    runs = []
    for one_call in (True, False):
        with torch.no_grad(), fast.fixed_width(dtype != torch.float32), \
                fast.kernels_up_to("passes" if one_call else "blocks"):
            runs.append(_decode_with_caches(DecoderView(model), ids, bounds, layers))
    (logits, cache), (reference, expected) = runs
    assert torch.equal(logits, reference)
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, expected.keys + expected.values))
    assert (cache.lengths == expected.lengths).all() and (cache.lengths == 26).all()
    assert pass_calls == [(2, rows) for rows in (8, 22, 2, 2) for _ in layers]


def test_rows_at_different_slots_lend_their_own_slots_and_an_unreadable_block_runs_block_by_block(pass_calls):
    """The cache lends rows at different slots each row's first slot (the pass writes each at its own);
    the pass falls back, having computed nothing, where a block's weight is no longer what the kernels
    read (made non-contiguous after the view was built); the logits still equal the model's."""
    model = tiny_model("qwen2")
    view = DecoderView(model)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        cache = KVCache(view.num_layers, 2, 32)
        positions = view.default_positions(ids[:, :8])
        cache.set_positions(positions, [0, 0])
        view.run_layers(view.embed(ids[:, :8], positions), 0, view.num_layers, cache, positions, aligned=True)
        assert cache.slot_buffers(0, view.num_layers) is not None
        cache.set_positions(positions[:, :1] + torch.tensor([[8], [7]]), [8, 7])
        assert cache.slot_buffers(0, view.num_layers)[4].tolist() == [8, 7]  # rows at slots 8 and 7
        assert pass_calls == []
        up = view.layers[1].mlp.up_proj.weight
        up.data = up.data.t().contiguous().t()  # the same values, transposed in memory
        logits = _decode_through_cache(view, ids, [(0, 8), (8, 11), (11, 12)])
        torch.testing.assert_close(logits[:, 8:], model(ids).logits[:, 8:], rtol=1e-5, atol=1e-5)
    assert len(pass_calls) == 2  # the kernel was asked twice and declined: nothing was written twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_block_kernels_silu_matches_torch_far_out_where_its_exp_saturates(dtype, few_rows, monkeypatch):
    """Gate values in the hundreds (the kernel's vectorized exp clamps its argument past ±88): SiLU still
    gives the gate itself far above 0 and (almost) 0 far below, as torch's operations do."""
    from selfspec.model import fast

    model = tiny_model("llama").to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(2000)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (1, 10))
    runs = []
    for block_kernel in (True, False):
        with torch.no_grad(), fast.fixed_width(dtype != torch.float32), \
                fast.kernels_up_to("blocks" if block_kernel else "products"):
            runs.append(_decode_with_caches(view, ids, [(0, 8), (8, 9), (9, 10)])[0][:, 8:].float())
    assert runs[0].isfinite().all()
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-4 * runs[1].abs().max().item())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_block_kernels_in_bf16_track_the_operations_they_replace(family, few_rows, monkeypatch):
    """In bf16 the compiled halves round where torch's operations round (the normalised row, each
    product, each rotary term, the residuals, silu and its product): a verification's hidden states
    stay within a step or two of bf16 of the per-operation path with the few-row kernel."""
    from selfspec.model import fast

    model = tiny_model(family).to(torch.bfloat16)
    view = DecoderView(model)
    ids = torch.randint(0, 96, (1, 12))
    runs = []
    for block_kernel in (True, False):
        cache = KVCache(view.num_layers, 1, 32)
        level = "blocks" if block_kernel else "products"
        with torch.no_grad(), fast.fixed_width(), fast.kernels_up_to(level):
            for start, end in [(0, 8), (8, 12)]:
                positions = view.default_positions(ids[:, start:end], start)
                kv_length = cache.set_positions(positions, [start])
                hidden = view.run_layers(view.embed(ids[:, start:end], positions), 0, view.num_layers, cache,
                                         positions, kv_length=kv_length, aligned=True)
        runs.append(hidden.float())
    scale = runs[1].abs().max()
    assert (runs[0] - runs[1]).abs().max() <= 2 ** -6 * scale
    assert (runs[0] == runs[1]).float().mean() > 0.9  # most values the same to the bit


def test_keys_the_attention_kernel_cannot_read_in_place_take_the_tensor_attention(block_calls, monkeypatch):
    """Keys the few-query kernel cannot read (another cache layout): the front half still runs, the
    attention and MLP run as tensor operations, and the logits equal the model's."""
    from selfspec.model import kernels

    monkeypatch.setattr(kernels, "few_queries_attention", lambda: None)
    model = tiny_model("mistral")
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        logits = _decode_through_cache(DecoderView(model), ids, [(0, 8), (8, 11), (11, 12)])
        torch.testing.assert_close(logits[:, 8:], model(ids).logits[:, 8:], rtol=1e-5, atol=1e-5)
    assert {half for half, _ in block_calls} == {"front"}


def test_angles_broadcast_over_the_batch_reach_every_row_of_the_block_kernels(few_rows, monkeypatch):
    """Hugging Face's rotary returns (1, T, hd) angles for a batch at shared positions: every row of
    the block kernels reads them, as the tensor path broadcasts them."""
    from selfspec.model import fast

    view = DecoderView(tiny_model("qwen2"))
    block = view.adapter.fast.blocks[0]
    hidden = torch.randn(2, 3, view.config.hidden_size)
    positions = view.default_positions(hidden[:1, :, 0].long(), 5)
    cos, sin = view.adapter.block_extras(hidden[:1], positions)["position_embeddings"]  # (1, 3, hd)
    mask = torch.zeros(2, 1, 3, 3)
    mask[:, :, 0, 1:] = mask[:, :, 1, 2:] = torch.finfo(torch.float32).min
    outs = []
    with torch.no_grad():
        for block_kernel in (True, False):
            with fast.kernels_up_to("blocks" if block_kernel else "products"):
                outs.append(fast.run_block(block, 0, hidden, mask, None, cos, sin))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def _levels_on() -> tuple[bool, ...]:
    from selfspec.model import fast, kernels

    return tuple(kernels.settings().runs(level) for level in fast.KERNEL_LEVELS)


def test_kernel_levels_switch_the_compiled_paths_cumulatively_and_restore_them():
    from selfspec.model import fast

    default = _levels_on()  # all of them, none under SELFSPEC_KERNELS=0
    assert default in ((True,) * 5, (False,) * 5)
    with fast.kernels_up_to("blocks"):
        assert _levels_on() == (True, True, False, False, False)
        with fast.kernels_up_to(None):
            assert _levels_on() == (False,) * 5
        assert _levels_on() == (True, True, False, False, False)
    assert _levels_on() == default
    with pytest.raises(ValueError, match="kernel level 'fast' is not None or one of products"):
        with fast.kernels_up_to("fast"):
            pass
    assert _levels_on() == default


def test_the_kernel_settings_are_per_thread_and_reach_a_thread_started_in_a_copy_of_the_context():
    """`kernels_up_to` and `kernels.using` change the settings of the thread that enters them: another
    thread decoding meanwhile keeps its own (the default), and a thread whose target runs in
    `contextvars.copy_context()` starts with its starter's."""
    import contextvars

    from selfspec.model import fast, kernels

    inside, outside = threading.Event(), threading.Event()
    seen, default = {}, _levels_on()

    def other():  # runs while the main thread is inside its block, and changes its own settings
        inside.wait(10)
        seen["other"] = _levels_on(), kernels.settings().small_block_bytes
        with fast.kernels_up_to("products"):
            seen["other inside"] = _levels_on()
            outside.set()

    thread = threading.Thread(target=other)
    thread.start()
    with fast.kernels_up_to(None), kernels.using(small_block_bytes=7):
        inside.set()
        outside.wait(10)
        seen["main"] = _levels_on(), kernels.settings().small_block_bytes  # not the other thread's
        copied = threading.Thread(target=contextvars.copy_context().run, args=(lambda: seen.update(
            copied=(_levels_on(), kernels.settings().small_block_bytes)),))
        copied.start()
        copied.join()
    thread.join()
    assert seen["other"] == (default, 4 << 20)
    assert seen["other inside"] == (True, False, False, False, False)
    assert seen["main"] == seen["copied"] == ((False,) * 5, 7)
    assert _levels_on() == default and kernels.settings() == kernels.KernelSettings()


def test_wrapped_kernels_compose_and_end_with_their_block(few_rows):
    """`kernels.wrapped(fn)`: the accessors take their functions from fn(the extension), the wrapper
    entered first applied first, for the block only."""
    from selfspec.model import kernels

    order = []

    class Named:
        def __init__(self, module, name):
            self.module, self.name = module, name

        def __getattr__(self, attribute):
            order.append(self.name)
            return getattr(self.module, attribute)

    with kernels.wrapped(lambda module: Named(module, "outer")), \
            kernels.wrapped(lambda module: Named(module, "inner")):
        assert kernels.few_rows_linear() is few_rows
    assert order == ["inner", "outer"]
    assert kernels.extension().few_rows_linear is few_rows and order == ["inner", "outer"]
