"""Shared test helpers: tiny random models of every family the adapter supports (built in-process, no
downloads), the cache-free greedy reference, and the chi-square check of sampled tokens."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_config(family: str, num_layers: int = 4, vocab_size: int = 96, **overrides):
    common = {**_COMMON, "num_hidden_layers": num_layers, "vocab_size": vocab_size}
    if family == "llama":
        cfg = LlamaConfig(**common)
    elif family == "mistral":
        # A window shorter than the test sequences, so the sliding-window mask is exercised.
        cfg = MistralConfig(**common, sliding_window=8)
    elif family == "qwen2":
        cfg = Qwen2Config(**common, use_sliding_window=False)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=8)
    elif family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=num_layers, n_head=4, n_positions=256,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


_CLASSES = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
            "qwen3": Qwen3ForCausalLM, "gpt2": GPT2LMHeadModel}


def tiny_model(family: str, num_layers: int = 4, vocab_size: int = 96, seed: int = 0,
               attn_implementation: str = "sdpa", **overrides):
    """A random fp32 model in eval mode; weights scaled up so logits are far from uniform."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, num_layers, vocab_size, **overrides)
    cfg._attn_implementation = attn_implementation
    model = _CLASSES[family](cfg).float().eval()
    return model


def sharp_llama(vocab_size: int = 64, seed: int = 3):
    """A tiny Llama whose LM head is scaled ×20: distributions far from uniform, for sampling tests."""
    model = tiny_model("llama", vocab_size=vocab_size, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


def reference_greedy(model, prompt, max_new_tokens):
    """Plain greedy with no cache at all: argmax of the full model on the whole sequence, each step
    (on the model's device)."""
    ids = list(prompt)
    device = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def same_tokens(a: list[list[int]], b: list[list[int]]) -> int:
    """Positions where two batches of token lists agree."""
    return sum(x == y for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def low_alpha_model(family):
    """A tiny model whose early exits often disagree with the last layer (α around 0.3-0.7)."""
    model = tiny_model(family)
    if family == "gpt2":  # its 0.02-std init leaves random blocks near the identity: every exit agrees
        with torch.no_grad():
            for weight in model.transformer.h.parameters():
                if weight.dim() == 2:
                    weight.mul_(3)
    return model


P_MIN = 1e-3  # chi-square / KS threshold: a correct sampler fails one such test with probability 0.001



def chi_square_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of `tokens` to `probs`; categories expected fewer than 5 times are pooled.

    A token of probability zero is impossible under `probs`: its presence gives p = 0.
    """
    observed = np.bincount(tokens, minlength=len(probs)).astype(float)
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs.astype(np.float64) / probs.sum(dtype=np.float64) * len(tokens)
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    return stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue


def ranking_counts(token_ids, vocab_size: int) -> np.ndarray:
    """Token counts (V,) whose len(token_ids) most frequent ids are exactly `token_ids`: the
    `token_counts` that give a generator a draft head over those ids (draft_vocab_size = len)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    counts[np.asarray(token_ids)] = np.arange(len(token_ids), 0, -1) + 1
    return counts


# A ChatML template: tiny tokenizers trained here have none
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def assert_shape(report: dict, report_type) -> None:
    """A report holds every key its TypedDict (`selfspec.evaluation.results`) requires and no other."""
    from selfspec.evaluation.results import keys_of

    required, optional = keys_of(report_type)
    assert required <= set(report), f"missing {sorted(required - set(report))}"
    assert set(report) <= required | optional, f"undeclared {sorted(set(report) - required - optional)}"


def kernels_unavailable() -> None:
    """Skip the calling test where selfspec's CPU kernels did not build; fail it instead under
    SELFSPEC_REQUIRE_KERNELS=1 (`.ci/run`, where they must build: a kernel that stops compiling must not
    pass as skipped tests)."""
    import os

    import pytest

    reason = "selfspec's CPU kernels are not available here (needs a C++ compiler, ninja, AVX2)"
    if os.environ.get("SELFSPEC_REQUIRE_KERNELS") == "1":
        pytest.fail(f"{reason}; SELFSPEC_REQUIRE_KERNELS=1 requires them (see the kernels' build warning)")
    pytest.skip(reason)


def chat_generator(tiny_run: dict, **kwargs):
    """The servers' tests' generator: the tiny run's model with a ChatML template, the hybrid drafter at
    E = 2, k = 3; `kwargs` go to `SelfSpecGenerator` (a prefix cache, another drafter, say)."""
    from transformers import AutoModelForCausalLM

    from selfspec.decoding import SelfSpecGenerator
    tokenizer = type(tiny_run["tokenizer"]).from_pretrained(tiny_run["model"])
    tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"]).eval()
    kwargs = {"drafter": "hybrid", **kwargs}
    return SelfSpecGenerator(model, tokenizer, exit_layer=2, num_speculations=3, **kwargs)


def chat_checkpoint(tiny_run: dict, root, prompts: list[str]) -> dict:
    """The tiny run's model with a ChatML template saved as a checkpoint at ROOT/model (exit layer 2), and
    a prompt file ROOT/prompts.txt of `prompts`, one a line: {dir, model, tokenizer, prompts, root}."""
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoint import Provenance, save_tuned
    from selfspec.decoding import DecodeSettings
    tokenizer = type(tiny_run["tokenizer"]).from_pretrained(tiny_run["model"])
    tokenizer.chat_template = CHATML
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"]).eval()
    save_tuned(root / "model", model, tokenizer, settings=DecodeSettings(exit_layer=2),
               provenance=Provenance(kind="base"))
    (root / "prompts.txt").write_text("".join(f"{prompt}\n" for prompt in prompts))
    return {"dir": root / "model", "model": model, "tokenizer": tokenizer, "prompts": root / "prompts.txt",
            "root": root}


def step_joining(generator, first: list, schedule: dict, **engine_kwargs):
    """Continuous batching through the stepped engine (`generator.engine(**engine_kwargs)`): the requests
    `first` (`NewRow`s) start the batch, schedule[r]'s rows are added before step r (0-based, after the
    batch started, so they join it apart), and the engine is stepped until no row runs and none was
    added. Returns (the `GenerationOutput`, per step its `RoundOutput`s)."""
    engine = generator.engine(**engine_kwargs)
    for row in first:
        engine.add(row)
    engine.start()
    steps = []
    while True:
        for row in schedule.get(len(steps), []):
            engine.add(row)
        if engine.done:
            return engine.output(), steps
        steps.append(engine.step())


def streamed(steps) -> dict:
    """Each row's tokens as the steps emitted them (`step_joining`'s steps): {row: tokens}."""
    seen: dict = {}
    for outputs in steps:
        for out in outputs:
            seen.setdefault(out.row, []).extend(out.tokens)
    return seen
