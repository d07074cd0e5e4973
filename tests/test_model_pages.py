"""The weights moved onto 2 MiB pages (`model/pages.py`): the same values, the same parameter objects,
tied weights still tied, the same greedy output, nothing moved where huge pages are not available."""

import pytest
import torch

from selfspec import SelfSpecGenerator
from selfspec.model import pages
from tests.helpers import reference_greedy, tiny_model

# 20,000 × 32 fp32 embeddings: 2.4 MiB, more than one huge page
VOCAB = 20_000


def _model(tied: bool):
    return tiny_model("llama", num_layers=2, vocab_size=VOCAB, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [True, False])
def test_the_weights_move_into_one_aligned_buffer_with_the_same_values_and_objects(tied):
    if not pages.huge_pages_available():
        pytest.skip("no transparent huge pages here")
    model = _model(tied)
    if tied:  # the tie as Hugging Face makes it: one parameter object in both places
        model.lm_head.weight = model.model.embed_tokens.weight
    prompt = [5, 17, 3, 99, 1234]
    before = reference_greedy(model, prompt, 6)
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}

    moved = pages.onto_huge_pages(model)

    assert moved >= sum(p.numel() * p.element_size() for p in params.values())
    after = dict(model.named_parameters())
    assert all(after[name] is p for name, p in params.items())
    assert all(torch.equal(p, values[name]) for name, p in after.items())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    starts = sorted(p.data_ptr() for p in after.values())
    assert starts[0] % pages.HUGE_PAGE == 0 and starts[-1] - starts[0] < moved  # one buffer
    assert reference_greedy(model, prompt, 6) == before
    generator = SelfSpecGenerator(model, exit_layer=1)
    assert generator.generate([prompt], max_new_tokens=6, eos_token_id=[]).sequences[0] == before
    assert "hg" in _vm_flags(starts[0])  # the buffer asked the kernel for huge pages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_views_and_a_tie_of_two_objects_on_one_storage_stay_where_they_are():
    if not pages.huge_pages_available():
        pytest.skip("no transparent huge pages here")
    model = _model(tied=False)
    shared = model.model.embed_tokens.weight
    model.lm_head.weight = torch.nn.Parameter(shared.data)  # another object, the same storage
    model.register_parameter("strided", torch.nn.Parameter(torch.randn(64, 64)[:, ::2]))
    strided = model.strided.data_ptr()
    assert pages.onto_huge_pages(model) > 0
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still one tensor
    assert model.strided.data_ptr() == strided


def test_nothing_moves_where_turned_off_or_not_linux(monkeypatch):
    model = _model(tied=False)
    starts = [p.data_ptr() for p in model.parameters()]
    monkeypatch.setenv("SELFSPEC_HUGE_PAGES", "0")
    assert not pages.huge_pages_available() and pages.onto_huge_pages(model) == 0
    monkeypatch.delenv("SELFSPEC_HUGE_PAGES")
    monkeypatch.setattr(pages.sys, "platform", "darwin")
    assert pages.onto_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == starts
    assert pages.empty_on_huge_pages(1 << 20).shape == (1 << 20,)  # still a tensor, on ordinary pages


def test_a_model_smaller_than_a_huge_page_stays_where_it_is():
    model = tiny_model("llama")
    starts = [p.data_ptr() for p in model.parameters()]
    assert pages.onto_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == starts
