"""bf16 and fp16: speculative output equals the engine's own plain output token for token.

In low precision a GEMM's rounding depends on how many rows it multiplies, so a verification of
k + 1 positions does not compute what k + 1 single plain steps compute, and greedy argmaxes flip.
The engine decodes low-precision models with `model.fast.fixed_width`: every attention on exactly
FIXED_WIDTH queries, and every product either on exactly FIXED_WIDTH rows (MKL) or through selfspec's
few-row kernel, whose rows never share a reduction (bf16 on AVX2 CPUs), whatever the number of
positions. These tests check the result on the
Llama-family blocks (`FastLlamaBlocks`); GPT-2 runs Hugging Face's own blocks, which it does not
cover.
"""

import pytest
import torch
from helpers import kernels_unavailable, low_alpha_model, ranking_counts

from selfspec.decoding import SelfSpecGenerator
from selfspec.model.exit_adapter import ExitBlock
from selfspec.model.fast import FIXED_WIDTH, fixed_width, linear

PROMPTS = [[5, 17, 33, 2, 71, 8, 5, 17, 33], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
NEW = 24
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def low_precision(family: str, dtype=torch.bfloat16):
    return low_alpha_model(family).to(dtype)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_row_computes_the_same_alone_or_among_others_at_fixed_width(dtype, kernel, kernel_level):
    """Through selfspec's kernel (bf16, where it builds) and through MKL's 16-row products alike."""
    kernel_level("rounds" if kernel else None)
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 64).to(dtype), torch.randn(300).to(dtype)
    x = torch.randn(7, 64).to(dtype)
    with fixed_width():
        together = linear(x, weight, bias)  # (7, 300): one call of the kernel, or of FIXED_WIDTH rows
        alone = torch.cat([linear(x[i:i + 1], weight, bias) for i in range(7)])
        many = linear(x.repeat(3, 1), weight, bias)  # 21 rows: two chunks
    assert torch.equal(together, alone) and torch.equal(many, together.repeat(3, 1))
    torch.testing.assert_close(together.float(), torch.nn.functional.linear(x, weight, bias).float(),
                               rtol=2e-2, atol=2e-2)
    assert FIXED_WIDTH >= 8  # covers a verification of k + 1 <= 8 positions in one product


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_every_drafter_in_bf16_gives_the_plain_bf16_output(family):
    """Early exit at several E and k, copies and the hybrid, η, a trimmed draft head and an exit block,
    batch 3 and batch 1: all equal to plain bf16 decoding of the same model."""
    model = low_precision(family)
    num_layers = model.config.num_hidden_layers
    plain = SelfSpecGenerator(model, exit_layer=2)
    assert plain.fixed_width
    expected = plain.generate(PROMPTS, max_new_tokens=NEW, num_speculations=0, eos_token_id=[]).sequences
    cases = [dict(exit_layer=e, num_speculations=k) for e in (1, 3) for k in (1, 4, 7)]
    cases += [dict(exit_layer=2, num_speculations=4, drafter=d) for d in ("ngram", "hybrid")]
    cases += [dict(exit_layer=2, num_speculations=4, stop_below=0.3)]
    accepted = 0
    for case in cases:
        generator = SelfSpecGenerator(model, **case)
        for batch in (PROMPTS, PROMPTS[:1]):
            out = generator.generate(batch, max_new_tokens=NEW, eos_token_id=[])
            assert out.sequences == expected[:len(batch)], (family, case, len(batch))
            accepted += out.stats.accepted
    assert accepted > 0
    trimmed = SelfSpecGenerator(model, exit_layer=2, num_speculations=3, draft_vocab_size=40,
                                token_counts=ranking_counts(range(40), 96))
    block = SelfSpecGenerator(model, exit_layer=num_layers - 1, num_speculations=3,
                              exit_adapters={num_layers - 1: ExitBlock.from_model(model, 0).eval()})
    for generator in (trimmed, block):
        assert generator.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[]).sequences == expected


def test_without_the_kernel_bf16_drafters_still_give_the_plain_bf16_output(kernel_level):
    """Where selfspec's kernel does not build, bf16 products run on MKL at fixed width: still lossless."""
    kernel_level(None)
    model = low_precision("llama")
    plain = SelfSpecGenerator(model, exit_layer=2)
    expected = plain.generate(PROMPTS, max_new_tokens=NEW, num_speculations=0, eos_token_id=[]).sequences
    for case in (dict(exit_layer=1, num_speculations=4),
                 dict(exit_layer=2, num_speculations=3, drafter="hybrid")):
        out = SelfSpecGenerator(model, **case).generate(PROMPTS, max_new_tokens=NEW, eos_token_id=[])
        assert out.sequences == expected, case


@pytest.mark.parametrize("kernel", [False, True])
def test_under_fixed_width_every_product_and_attention_has_the_same_shape(kernel, monkeypatch, kernel_level):
    """What makes positions independent of their pass: a decode (plain step, drafts, verification)
    either multiplies exactly FIXED_WIDTH rows in every MKL product and attends with exactly
    FIXED_WIDTH queries, or, with selfspec's kernels (bf16 on AVX2), runs every block through the
    block kernels and the head through the few-row kernel (products of at most 8 rows a call, no row
    sharing a reduction; every query attending alone), unpadded."""
    from selfspec.model import kernels

    if kernel and kernels.few_rows_linear() is None:
        kernels_unavailable()
    # the round's compiled calls (draft loop, verification) run these kernels from C++, out of sight
    # here: up to the passes, every call shows (their equality: tests/test_decoding_draft_loop.py)
    kernel_level("passes" if kernel else None)
    model = low_precision("qwen3")
    widths = set()
    mm, matmul = torch.mm, torch.matmul
    monkeypatch.setattr(torch, "mm", lambda a, b: widths.add(("mm", b.shape[1])) or mm(a, b))
    monkeypatch.setattr(torch, "matmul", lambda a, b: widths.add(("attention", a.shape[-2])) or matmul(a, b))
    if kernel:
        few_rows, (front, back) = kernels.few_rows_linear(), kernels.block_halves()
        block, run = kernels.blocks_pass()
        monkeypatch.setattr(kernels, "few_rows_linear",
                            lambda: lambda x, w: widths.add(("rows kernel", x.shape[0])) or few_rows(x, w))
        monkeypatch.setattr(kernels, "block_halves", lambda: (
            lambda hidden, *rest: widths.add(("block", hidden.shape[0] * hidden.shape[1]))
            or front(hidden, *rest), back))
        monkeypatch.setattr(kernels, "blocks_pass", lambda: (block, lambda blocks, hidden, *rest: widths.add(
            ("block", hidden.shape[0] * hidden.shape[1])) or run(blocks, hidden, *rest)))
    generator = SelfSpecGenerator(model, exit_layer=2)
    # The batch's prefill (3 x 10 positions, shared by every method) runs outside fixed width: its
    # products in one call (F.linear; the few-row kernel where the CPU emulates bf16), SDPA.
    out = generator.generate(PROMPTS, max_new_tokens=12, num_speculations=3, drafter="hybrid",
                             eos_token_id=[])
    assert out.stats.copy.tested > 0 and out.stats.early_exit.tested > 0
    kinds = {name for name, _ in widths}
    if kernel:  # every block in the block kernels (their products in chunks of at most 8 rows, their
        # queries each alone), unpadded: a verification of 3 rows x 4 positions is 12 rows; the head
        # through the few-row kernel, the 12 rows in one call
        assert kinds == {"rows kernel", "block"} and ("rows kernel", 12) in widths, widths
        assert ("block", 12) in widths and ("block", 3) in widths, widths
    else:  # a key/value head's g query heads attend as g·FIXED_WIDTH rows of one product
        groups = model.config.num_attention_heads // model.config.num_key_value_heads
        assert widths == {("mm", FIXED_WIDTH), ("attention", groups * FIXED_WIDTH)}, widths
