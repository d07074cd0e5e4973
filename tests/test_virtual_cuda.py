"""The paths only CUDA takes, on a CUDA device emulated on the CPU (`virtual_cuda`): no tensor of the
other device, no compiled CPU kernel given CUDA memory, no event read early; the tokens as plain
greedy decoding's on the same device. (The one GPU lent so far failed `test_on_cuda_...`; the
compiled round calls then took CUDA tensors.)"""

import pytest
import torch
from helpers import FAMILIES, low_alpha_model, reference_greedy, same_tokens, step_joining
from test_decoding_admit import LATER, SETTINGS
from test_decoding_grammar import DRAFTERS, PERSON, constrained_reference, make_model, prompt_ids, tokenizer  # noqa: F401
from virtual_cuda import Event, VirtualCuda

from selfspec import SelfSpecGenerator
from selfspec.decoding import NewRow
from selfspec.decoding.grammar import Constraint
from selfspec.decoding.ngram import NGramConfig
from selfspec.decoding.prefix import PrefixCache

PROMPTS = [[5, 17, 33, 2, 71, 8, 5, 17, 33], [40, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
NEW = 12


def test_the_virtual_device_refuses_what_cuda_refuses():
    with VirtualCuda() as device:
        x, y = torch.ones(3).cuda(), torch.ones(3)
        assert x.device.type == "cuda" and y.device.type == "cpu" and (x + 1).is_cuda
        assert (x * torch.tensor(2.0)).is_cuda  # a CPU scalar may join
        with pytest.raises(RuntimeError, match="same device"):
            torch.cat([x, y])
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert x.cpu().numpy().tolist() == [1, 1, 1] and not x.cpu().is_cuda
        assert torch.zeros(2, device="cuda").is_cuda and torch.zeros_like(x).is_cuda
        assert x[:2].is_cuda and x.to("cpu").device.type == "cpu" and y.to(x).is_cuda
        host = torch.zeros(3)
        host.copy_(x)  # a copy between devices leaves each tensor where it was
        assert not host.is_cuda and x[torch.tensor([0, 2])].is_cuda  # CPU indices may index CUDA memory
        start, end = Event(enable_timing=True), Event(enable_timing=True)
        start.record(), (x * 2).sum(), end.record()
        with pytest.raises(RuntimeError, match="not ready"):
            start.elapsed_time(end)
        (x * 2).sum().item()  # a host read waits for the work queued before it
        assert start.elapsed_time(end) >= 0
        model = device.module(torch.nn.Linear(3, 2))
        assert model.weight.is_cuda and model(x).is_cuda
        with pytest.raises(RuntimeError, match="same device"):
            model(y)
    assert not torch.ones(1).is_cuda  # outside the block: the CPU again


def test_the_virtual_device_counts_syncs_both_ways():
    """A host read waits for the device; so does a copy up from pageable memory (and torch's blocking
    copy): both are counted, and only a non-blocking copy from pinned memory is queued without a wait."""
    with VirtualCuda() as device:
        counts = lambda: (device.host_reads, device.host_uploads)
        start = counts()
        delta = lambda: tuple(b - a for a, b in zip(start, counts()))
        x = torch.ones(4).cuda()
        assert delta() == (0, 1)  # `.cuda()` of pageable memory
        torch.tensor([1, 2], device="cuda"), torch.as_tensor([3.0], device="cuda"), torch.ones(2).to(x)
        assert delta() == (0, 4)
        x[torch.tensor([0, 2])]  # host indices go up
        x.index_put_((torch.tensor([1]),), torch.zeros(1).cuda())
        assert delta() == (0, 7)
        x.copy_(torch.zeros(4))
        assert delta() == (0, 8)
        pinned = torch.arange(4.0).pin_memory()
        assert pinned.is_pinned() and torch.zeros(2, pin_memory=True).is_pinned()
        assert not torch.zeros(1).is_pinned()
        up = pinned.to("cuda", non_blocking=True)
        x.copy_(pinned, non_blocking=True)
        assert up.is_cuda and x.tolist() == [0, 1, 2, 3] and delta() == (1, 8)  # only the tolist waited
        pinned.to("cuda"), pinned.cuda()  # pinned but blocking: torch waits
        assert delta() == (1, 10)
        torch.zeros(3, device="cuda"), torch.full((2,), 7, device="cuda"), x * torch.tensor(2.0)
        assert delta() == (1, 10)  # made on the device; a host scalar rides with the kernel
        torch.zeros(4).copy_(x), x.cpu(), int(x[0]), torch.cuda.synchronize()
        assert delta() == (5, 10) and device.syncs - sum(start) == 15


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_on_virtual_cuda_is_plain_greedy_for_every_drafter(family):
    model = low_alpha_model(family)
    with VirtualCuda() as device:
        device.module(model)
        expected = [reference_greedy(model, p, NEW) for p in PROMPTS]
        generator = SelfSpecGenerator(model, exit_layer=2, ngram=NGramConfig(max_ngram=3, min_ngram=2))
        for drafter, k in (("early_exit", 0), ("early_exit", 1), ("early_exit", 4), ("early_exit", "auto"),
                           ("ngram", 3), ("hybrid", 2)):
            out = generator.generate(PROMPTS, max_new_tokens=NEW, num_speculations=k, drafter=drafter,
                                     eos_token_id=[])
            assert out.sequences == expected, (family, drafter, k)
            assert out.stats.verify_time + out.stats.plain_time > 0
            one = generator.generate(PROMPTS[:1], max_new_tokens=NEW, num_speculations=k, drafter=drafter,
                                     eos_token_id=[])  # a lone row: the CPU's compiled rounds decline
            assert one.sequences == expected[:1], (family, drafter, k)


def test_sampling_on_virtual_cuda_draws_the_cpu_tokens():
    model = low_alpha_model("llama")
    kwargs = dict(max_new_tokens=NEW, temperature=0.8, num_speculations=3, seed=1, eos_token_id=[])
    on_cpu = SelfSpecGenerator(model, exit_layer=2).generate(PROMPTS, **kwargs).sequences
    with VirtualCuda() as device:
        device.module(model)
        sampled = SelfSpecGenerator(model, exit_layer=2).generate(PROMPTS, **kwargs).sequences
    # the same uniforms; the kernels and torch's operations may round a near-tie apart
    assert same_tokens(sampled, on_cpu) >= 0.9 * NEW * len(PROMPTS)


def test_structured_output_on_virtual_cuda_is_constrained_plain_greedy(tokenizer):  # noqa: F811
    model = make_model("llama", tokenizer)
    prompt = prompt_ids(tokenizer)
    expected, complete = constrained_reference(model, tokenizer, prompt, Constraint.of(PERSON), 60)
    with VirtualCuda() as device:
        device.module(model)
        generator = SelfSpecGenerator(model, tokenizer, drafter="ngram")
        for name, settings in DRAFTERS.items():
            out = generator.generate([prompt], max_new_tokens=60, json_schema=PERSON, settings=settings)
            assert out.sequences[0] == expected and out.complete == [complete], name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_servers_path_on_virtual_cuda_joining_rows_and_a_prefix_cache(family):
    """What `selfspec serve` runs on a GPU: rows that join at round boundaries, prefilled through a
    prefix cache, greedy batches over `draft_max_rows` as plain steps; each row as plain greedy alone."""
    model = low_alpha_model(family)
    first = PROMPTS[:2]
    later = [row for rows in LATER.values() for row in rows]
    with VirtualCuda() as device:
        device.module(model)
        expected = ([reference_greedy(model, p, NEW) for p in first]
                    + [reference_greedy(model, r.prompt, r.max_new_tokens) for r in later])
        cache = PrefixCache(chunk=4)
        generator = SelfSpecGenerator(model, exit_layer=2, prefix_cache=cache)
        for name, settings in SETTINGS.items():
            for draft_max_rows in (None, 2):
                out, _ = step_joining(generator, [NewRow(p, NEW) for p in first], LATER, eos_token_id=[],
                                      settings=settings, draft_max_rows=draft_max_rows)
                assert out.sequences == expected, (family, name, draft_max_rows)
        assert cache.hit_tokens > 0
