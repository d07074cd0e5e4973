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


IMPLICIT_SYNCS = {  # each waits on real CUDA: the host reads a size or a value first, or copies up
    "nonzero": lambda x, m: x.nonzero(),
    "a boolean mask": lambda x, m: x[m],
    "a tensor under a boolean mask": lambda x, m: x.__setitem__(m, x[:2] * 0),
    "masked_select": lambda x, m: torch.masked_select(x, m),
    "unique": lambda x, m: torch.unique(x),
    "where(condition)": lambda x, m: torch.where(m),
    "repeat_interleave": lambda x, m: x.repeat_interleave(m.long()),
    "bincount": lambda x, m: torch.bincount(m.long()),
    "equal": lambda x, m: torch.equal(x, x),
    "allclose": lambda x, m: torch.allclose(x, x),
    "a 0-dim host tensor copied in": lambda x, m: x[0].copy_(torch.tensor(5.0)),
    "a 0-dim host tensor assigned": lambda x, m: x.__setitem__(1, torch.tensor(5.0)),
}
NO_SYNC = {  # the same work with sizes the host knows
    "where(condition, a, b)": lambda x, m: torch.where(m, x, 0.0),
    "repeat_interleave with output_size": lambda x, m: x.repeat_interleave(m.long(), output_size=2),
    "a number under a boolean mask": lambda x, m: x.__setitem__(m, 0.0),
    "a 0-dim host tensor as an operand": lambda x, m: x * torch.tensor(2.0),
}


@pytest.mark.parametrize("name", [*IMPLICIT_SYNCS, *NO_SYNC])
def test_the_virtual_device_counts_the_syncs_cuda_makes_without_a_read(name):
    """Where a result's size comes from device data (`nonzero`, a mask as an index, ...), a value is
    compared on the host (`equal`), or a 0-dim host tensor is copied into device memory, CUDA waits for
    the device though no `.item()` is written: one sync each; the same work with known sizes, none."""
    with VirtualCuda() as device:
        x = torch.tensor([1.0, 2.0, 2.0, 3.0], device="cuda")
        m = torch.tensor([True, False, True, False], device="cuda")
        before = device.syncs
        (IMPLICIT_SYNCS | NO_SYNC)[name](x, m)
        assert device.syncs - before == (1 if name in IMPLICIT_SYNCS else 0), name


LAUNCHES = {  # (operation, kernel launches on CUDA)
    "sort": (lambda x: x.sort(), 1),
    "max over a dimension": (lambda x: x.max(-1), 1),
    "topk": (lambda x: x.topk(2), 1),
    # a gather (the indices themselves: an upload)
    "an index of device indices": (lambda x: x[torch.tensor([0, 2], device="cuda")], 1),
    "out=": (lambda x: torch.add(x, x, out=torch.empty_like(x)), 1),
    "a dtype conversion": (lambda x: x.to(torch.float64), 1),
    "a slice": (lambda x: x[1:], 0),
    "a view": (lambda x: x.view(2, 2), 0),
}


@pytest.mark.parametrize("name", LAUNCHES)
def test_the_virtual_device_counts_every_launch(name):
    """Every operation with a result in new device memory is a launch, tuples' (`sort`, `max(dim)`)
    and indexing's included; a view is none."""
    op, launches = LAUNCHES[name]
    with VirtualCuda() as device:
        x = torch.tensor([4.0, 1.0, 3.0, 2.0], device="cuda")
        before = device.kernel_launches
        op(x)
        assert device.kernel_launches - before == launches, name


def test_a_replay_launches_a_copy_for_each_argument_it_copies_in():
    """A CUDA graph reads its inputs from its own buffers: each call copies every dynamic argument in
    (a copy launch each) before the one graph launch; the static ones (the cache) are read in place."""
    from selfspec.backends.graphs import CapturedPass

    with VirtualCuda() as device:
        cache = torch.zeros(4, device="cuda")
        captured = CapturedPass(lambda a, b, kv: (a * b + kv.sum()), static=(2,), device=torch.device("cuda"))
        a, b = torch.ones(4, device="cuda"), torch.ones(4, device="cuda")
        captured(a, b, cache)  # the capture
        before = device.kernel_launches, device.graph_launches
        captured(a, b, cache)
        launches = device.kernel_launches - before[0], device.graph_launches - before[1]
    assert launches == (2 + 1, 1)  # a and b copied in, the output copied out; one graph


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
