"""The device check: selfspec on one lent GPU, with nothing from outside, in one call of at most 8 minutes.

    python tools/device_check.py --out DIR                 # every stage, each under its own timeout
    python tools/device_check.py --out DIR --only shapes   # some stages again
    python tools/device_check.py --out DIR --tiny          # tiny sizes (tests/test_device_check.py)

Every stage runs in a process of its own under a timeout and appends its verdict lines to
DIR/verdicts.txt the moment it has them (a stage killed at its limit keeps what it wrote); its full output
goes to DIR/<stage>.log. The models are made on the device: tiny random models of every family, real
architectures at their real shapes with random weights (configs in tools/device_configs/), and a
GPU-sized embedded default pretrained on the device's own Python standard library. Stages:

- env: the device, torch and transformers;
- lossless: every family x drafter (early exit k = 1, 4, auto; copies; hybrid; static passes eager and
  compiled) equal to the engine's own plain greedy on the same device (fp32), Hugging Face's greedy kept
  apart (agreement, not losslessness);
- shapes: bf16 plain decoding at batch 1 on real shapes: tokens/s of selfspec (eager, static passes
  compiled) against Hugging Face eager `generate` and Hugging Face with a static cache and
  `torch.compile` (what a GPU user picks); kernel launches per plain token; c and v (a draft step and a
  verification of k + 1 positions, each over a plain step);
- embedded: the embedded default made GPU-sized (same recipe, wider and deeper), pretrained here, then
  fine-tuned with layer dropout and exit losses; α, and the early exit's tokens/s over its own plain
  decoding (eager and static), each lossless in bf16 against the same path's plain decoding; then 20
  steps at the GPU recipes' settings (bf16, lr 2e-5): step time, peak memory, the share of weights changed
  beside pure bf16's and float32 training's from the same weights;
- zero2: where a DeepSpeed wheel built elsewhere imports, ZeRO-2 through accelerate on the embedded
  default's fine-tune: its steps' losses and time, on what the 8 minutes have left.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tools" / "device_configs"
# (name, seconds): each stage's limit, and never more than what is left of the 8 minutes (`BUDGET`), so one
# call leaves time for a rerun in 15; the last, ZeRO-2, runs on what the others left (at most its 60 s)
STAGES = {"env": 20, "lossless": 60, "shapes": 100, "graphs": 110, "embedded": 190, "zero2": 60}
BUDGET = 8 * 60
MIN_SECONDS = {"zero2": 45}  # a stage starts only with this much left (else 5 s)
OPTIONAL = {"zero2"}  # skipped for want of time, not a failure of the check
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


class Check:
    """What a stage shares: its output folder, sizes, the device and how models get there."""

    def __init__(self, out: Path, tiny: bool, device: str | None = None, move=None):
        import torch
        self.out, self.tiny = out, tiny
        self.device = device or ("cuda" if torch.cuda.is_available() or move is not None else "cpu")
        self._move = move  # the emulated device's `module` (it moves a model's weights); None: .to(device)

    def verdict(self, stage: str, text: str) -> None:
        line = f"{stage:<9} {text}"
        print(line, flush=True)
        with open(self.out / "verdicts.txt", "a") as f:
            f.write(line + "\n")

    def move(self, model):
        return self._move(model) if self._move is not None else model.to(self.device)

    @property
    def real_cuda(self) -> bool:
        import torch
        return self._move is None and self.device == "cuda" and torch.cuda.is_available()

    def sync(self) -> None:
        import torch
        if self.real_cuda:
            torch.cuda.synchronize()


# -- the stages ----------------------------------------------------------------------------------------
def stage_env(c: Check) -> None:
    import torch
    import transformers
    if c.real_cuda:
        p = torch.cuda.get_device_properties(0)
        device = f"{p.name}, {p.total_memory / 2**30:.0f} GiB"
    else:
        device = "emulated CUDA device (tests/virtual_cuda.py)" if c._move else "no CUDA device"
    c.verdict("env", f"{device}; torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"python {sys.version.split()[0]}")


def _tiny_model(family: str, seed: int = 0):
    sys.path.insert(0, str(ROOT))
    from tests.helpers import tiny_model
    return tiny_model(family, num_layers=4, seed=seed)


def stage_lossless(c: Check) -> None:
    """fp32: every drafter equal to the engine's plain greedy on the same device and path."""
    import torch

    from selfspec.decoding import SelfSpecGenerator
    cases = [("early_exit", 1), ("early_exit", 4), ("early_exit", "auto"), ("ngram", None), ("hybrid", 4)]
    statics = ["eager", "graph"]
    new = 12 if c.tiny else 24
    for family in FAMILIES:
        model = c.move(_tiny_model(family))
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9)]
        prompts[1][5:] = prompts[1][:4]  # a repeat, so copies have something to copy
        gen = SelfSpecGenerator(model, exit_layer=2)
        plain = gen.generate(prompts, max_new_tokens=new, num_speculations=0, eos_token_id=[]).sequences
        bad = [f"{d} k={k}" for d, k in cases
               if gen.generate(prompts, max_new_tokens=new, drafter=d, num_speculations=k,
                               eos_token_id=[]).sequences != plain]
        hf = _hf_greedy(model, prompts, new)
        text = [f"eager: {'lossless' if not bad else 'NOT lossless (' + ', '.join(bad) + ')'}",
                f"HF greedy agrees on {sum(a == b for a, b in zip(hf, plain))}/{len(plain)} rows"]
        if family != "gpt2":
            sampled = {}  # mode -> a sampled decode's tokens: on graphs, drawn on the device
            for mode in statics:
                s = SelfSpecGenerator(model, exit_layer=2, static_passes=mode)
                sampled[mode] = s.generate(prompts, max_new_tokens=new, num_speculations=3, temperature=0.9,
                                           seed=5, eos_token_id=[]).sequences
                s_plain = s.generate(prompts, max_new_tokens=new, num_speculations=0,
                                     eos_token_id=[]).sequences
                s_bad = [f"{d} k={k}" for d, k in cases
                         if s.generate(prompts, max_new_tokens=new, drafter=d, num_speculations=k,
                                       eos_token_id=[]).sequences != s_plain]
                verdict = "lossless" if not s_bad else f"NOT lossless ({', '.join(s_bad)})"
                text.append(f"static {mode}: {verdict}"
                            f"{'' if s_plain == plain else ' (its plain differs from eager plain)'}")
                if mode == "graph":
                    same = sampled["graph"] == sampled["eager"]
                    text.append(f"sampled {'equal to' if same else 'NOT equal to'} the passes as written")
                    text.append(_changing_batch(s, prompts, new))
        c.verdict("lossless", f"{family}: " + "; ".join(text))


def _hf_greedy(model, prompts, new):
    import torch
    rows = []
    device = next(model.parameters()).device
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        rows.append(out[0, len(p):].tolist())
    return rows


def _real_shape(c: Check, name: str, dtype):
    """A model of the named architecture at its real shape, random weights (std 0.02), on the device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    if c.tiny:  # the dry run: the same architecture, tiny
        config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, head_dim=16)
    cfg = AutoConfig.for_model(**config)
    cfg.eos_token_id = None
    torch.manual_seed(0)
    with torch.device("cuda" if c.real_cuda else "cpu"):  # initialised where it runs: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if not c.real_cuda:
        model = c.move(model)
    model.generation_config.eos_token_id = None
    return model


def _timed(c: Check, fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        c.sync()
        t = time.perf_counter()
        fn()
        c.sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _launches(c: Check, fn) -> int | None:
    """Kernel and graph launches the host made during fn() (CUDA's runtime calls, torch's profiler)."""
    if not c.real_cuda:
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        c.sync()
    names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
             "cudaGraphLaunch")
    return sum(e.count for e in prof.key_averages() if e.key in names)


def stage_shapes(c: Check) -> None:
    """Eager decoding on real shapes (seconds each)."""
    for name in ("llama-3.2-1b", "smollm2-135m", "qwen2.5-0.5b"):
        _eager_shape(c, name)


def _eager_shape(c: Check, name: str) -> None:
    import torch

    from selfspec.decoding import SelfSpecGenerator
    new, repeats = (8, 1) if c.tiny else (64, 3)
    model = _real_shape(c, name, torch.bfloat16)
    n, exit_layer = model.config.num_hidden_layers, max(1, model.config.num_hidden_layers // 3)
    prompt = torch.randint(0, 200, (1, 32), generator=torch.Generator().manual_seed(0)).to(c.device)
    hf = new / _timed(c, lambda: _hf_generate(model, prompt, new), repeats)
    gen = SelfSpecGenerator(model, exit_layer=exit_layer)
    ids = prompt[0].tolist()
    plain = lambda: gen.generate([ids], max_new_tokens=new, num_speculations=0, eos_token_id=[])
    ours = new / _timed(c, plain, repeats)
    launches = _launches(c, plain)
    spec = gen.generate([ids], max_new_tokens=new, num_speculations=4, eos_token_id=[]).stats
    plain_stats = plain().stats
    step = plain_stats.plain_time / max(plain_stats.plain_steps, 1)
    c_ratio = spec.draft_time / max(spec.draft_steps, 1) / step
    v_ratio = spec.verify_time / max(spec.rounds, 1) / step
    c.verdict("shapes", f"{name} bf16 batch 1, eager ({n} layers): HF {hf:.0f} tok/s, selfspec {ours:.0f} "
                        f"tok/s ({ours / hf:.2f}x), plain step {step * 1e3:.2f} ms, "
                        f"{'n/a' if launches is None else f'{launches / new:.0f}'} launches/plain token; "
                        f"at E={exit_layer}: c {c_ratio:.2f}, v(k=4) {v_ratio:.2f} of a plain step")
    if c.real_cuda:
        del model, gen
        torch.cuda.empty_cache()


def _changing_batch(gen, prompts: list, new: int) -> str:
    """A server's batch on captured passes: rows that finish at different rounds and one that joins,
    decoded three times; each row against its plain greedy alone, and the graphs the third call
    captured (none: every batch size's graphs are kept on the pool's buffers, `CachePool`)."""
    from selfspec.decoding import NewRow

    def once():  # k fixed: an adaptive k follows the measured times, and the batch's sizes with it
        engine = gen.engine(gen.settings.override(num_speculations=3), eos_token_id=[])
        for i, p in enumerate(prompts):
            engine.add(NewRow(p, new - 4 * i))
        engine.step()
        engine.add(NewRow(prompts[0], new // 2))  # joins the running batch
        while not engine.done:
            engine.step()
        return engine.output().sequences

    captures = lambda: sum(fn.captures for fn in gen.backend.passes._functions.values())
    once(), once()
    before = captures()
    got = once()
    repeated = captures() - before
    want = [gen.generate([p], max_new_tokens=n, num_speculations=0, eos_token_id=[]).sequences[0]
            for p, n in [*((p, new - 4 * i) for i, p in enumerate(prompts)), (prompts[0], new // 2)]]
    return (f"a changing batch {'lossless' if got == want else 'NOT lossless'}, "
            f"{repeated} captures when it repeats")


def stage_graphs(c: Check) -> None:
    """The 1B shape captured: selfspec's static passes as CUDA graphs against Hugging Face with a static
    cache and torch.compile (compiled; a minute), plain and early exit, bf16, batch 1."""
    import torch

    from selfspec.decoding import SelfSpecGenerator
    new, repeats = (8, 1) if c.tiny else (64, 3)
    name = "llama-3.2-1b"
    model = _real_shape(c, name, torch.bfloat16)
    n = model.config.num_hidden_layers
    prompt = torch.randint(0, 200, (1, 32), generator=torch.Generator().manual_seed(0)).to(c.device)
    ids = prompt[0].tolist()
    gen = SelfSpecGenerator(model, exit_layer=n // 3, static_passes="graph")
    plain = lambda: gen.generate([ids], max_new_tokens=new, num_speculations=0, eos_token_id=[])
    start = time.perf_counter()
    ours = new / _timed(c, plain, repeats)
    launches = _launches(c, plain)
    stats = plain().stats
    step = stats.plain_time / max(stats.plain_steps, 1)
    spec = gen.generate([ids], max_new_tokens=new, num_speculations=4, eos_token_id=[])
    same = spec.sequences == plain().sequences
    c_ratio = spec.stats.draft_time / max(spec.stats.draft_steps, 1) / step
    v_ratio = spec.stats.verify_time / max(spec.stats.rounds, 1) / step
    spec_launches = _launches(c, lambda: gen.generate([ids], max_new_tokens=new, num_speculations=4,
                                                      eos_token_id=[]))
    per = lambda x, d: "n/a" if x is None else f"{x / d:.1f}"
    c.verdict("graphs", f"{name} bf16 batch 1, selfspec static passes as CUDA graphs: plain {ours:.0f} "
                        f"tok/s, step {step * 1e3:.2f} ms, {per(launches, new)} launches/plain token; early "
                        f"exit E={n // 3} k=4 {'lossless' if same else 'NOT lossless'} against it, "
                        f"{per(spec_launches, spec.stats.rounds)} launches/round, c {c_ratio:.2f}, "
                        f"v {v_ratio:.2f} of a plain step "
                        f"({time.perf_counter() - start:.0f} s)")
    if not c.real_cuda:
        return  # torch.compile needs the real device
    try:
        static = lambda: _hf_generate(model, prompt, new, cache_implementation="static")
        start = time.perf_counter()
        static()  # compiles
        hf = new / _timed(c, static, repeats)
        # generate compiles the forward itself on CUDA with a static cache (`_valid_auto_compile_criteria`)
        compiled = "compiled" if hasattr(model, "_compiled_call") else "NOT compiled by generate"
        c.verdict("graphs", f"{name}: HF static cache + torch.compile {hf:.0f} tok/s ({compiled}); selfspec "
                            f"graphs plain {ours / hf:.2f}x it (HF compiled and timed in "
                            f"{time.perf_counter() - start:.0f} s)")
    except Exception as e:  # noqa: BLE001 - the verdict says what failed
        c.verdict("graphs", f"{name}: HF static cache + torch.compile FAILED: {type(e).__name__}: "
                            f"{str(e)[:300]}")


def _hf_generate(model, prompt, new: int, **kwargs):
    """Hugging Face greedy `generate` of exactly `new` tokens from prompt (1, T)."""
    import torch
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)


def _share_changed(base_dir: Path, tuned_dir: Path) -> float:
    """Share of the blocks' matrices that differ from the base, both rounded to bf16, the GPU recipes'
    saved precision (norm weights sit at 1.0, below any step's reach in bf16, and an embedding row trains
    only when its token is seen)."""
    import torch
    from safetensors.torch import load_file
    base = {k: v for f in sorted(base_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    tuned = {k: v for f in sorted(tuned_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    changed = total = 0
    for k, t in tuned.items():
        if k in base and base[k].shape == t.shape and t.dim() == 2 and ".layers." in k:
            changed += int((base[k].to(torch.bfloat16) != t.to(torch.bfloat16)).sum())
            total += t.numel()
    return changed / max(total, 1)


def stage_embedded(c: Check) -> None:
    """Pretrain the GPU-sized embedded default, check that the GPU recipes' settings keep their updates,
    fine-tune it, then decode: α, speed over its own plain decoding, losslessness."""
    import torch

    from selfspec.config import load_config
    from selfspec.training.loop import train
    runs, common, tune = _embedded_runs(c)
    if c.tiny:
        arch = ["model.arch.hidden_size=32", "model.arch.num_layers=4", "model.arch.intermediate_size=64",
                "data.tokenizer_vocab_size=512", "data.block_size=64", "optim.max_steps=4",
                "optim.batch_size=2"]
        tune_steps = 4
    else:  # the embedded recipe, wider (512) and deeper (16 blocks), bf16 autocast
        arch = ["model.arch.hidden_size=512", "model.arch.num_layers=16", "model.arch.num_heads=8",
                "model.arch.num_kv_heads=4", "model.arch.intermediate_size=1536", "data.block_size=512",
                "optim.max_steps=800", "optim.batch_size=32", "optim.lr=1.5e-3", "mixed_precision=bf16"]
        tune_steps = 200
    base = runs / "base" / "model"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "selfspec", "pretrain", "--config", "embedded_base", "--output-dir",
                    str(runs / "base"), "--force", *arch, *common], check=True, cwd=ROOT)
    c.verdict("embedded", f"pretrained in {time.perf_counter() - start:.0f} s "
                          f"(corpus and tokenizer from this machine's standard library included)")

    from accelerate.state import AcceleratorState
    start = time.perf_counter()
    cfg = load_config("demo_finetune", [f"model.name_or_path={base}", f"optim.max_steps={tune_steps}", *tune,
                                        *common, f"output_dir={runs / 'demo'}"])
    train(cfg, kind="tuned", overwrite=True, progress=False)
    c.verdict("embedded", f"fine-tuned ({tune_steps} steps, layer dropout and exit losses) in "
                          f"{time.perf_counter() - start:.0f} s")

    for dtype, static in (("bfloat16", "graph"), ("bfloat16", None), ("float32", "graph")):
        _decode_tuned(c, runs / "demo" / "model", dtype, static)

    # last, so that a stage cut at its limit has said the decoding verdicts first:
    # the GPU recipes' settings: bf16 weights asked for, bf16 autocast, lr 2e-5, 20 steps, every weight;
    # then the same steps in pure bf16 and in float32 from the same bf16 weights: how many weights 20
    # steps move past half a bf16 spacing is the data's and the weights' (on the CPU's embedded default
    # 59 % of the blocks' in float32), so the master weights keep their updates when they move as many
    steps = 4 if c.tiny else 20
    rounded = _rounded_to_bf16(base, runs / "base_bf16")
    shares = {}
    for name, extra in (("master", ["model.dtype=bfloat16", "mixed_precision=bf16"]),
                        ("pure", ["model.dtype=bfloat16", "mixed_precision=bf16",
                                  "model.fp32_master_weights=false"]),
                        ("fp32", ["model.dtype=float32", "mixed_precision='no'"])):
        AcceleratorState._reset_state(reset_partial_state=True)  # each run in this process its own precision
        cfg = load_config("demo_finetune", [f"model.name_or_path={rounded}", *tune, *extra, "optim.lr=2e-5",
                                            "optim.warmup_steps=0", f"optim.max_steps={steps}", *common,
                                            f"output_dir={runs / name}"])
        if c.real_cuda:
            torch.cuda.reset_peak_memory_stats()
        result = train(cfg, kind="tuned", overwrite=True, progress=False)
        shares[name] = _share_changed(rounded, result.model_dir)
        if name == "master":
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if c.real_cuda else ""
            step = _step_ms(runs / name / "metrics.jsonl")
        if c.real_cuda:
            torch.cuda.empty_cache()
    keeps = shares["master"] >= 0.9 * shares["fp32"]
    c.verdict("embedded", f"GPU recipe settings (bf16, lr 2e-5), {steps} steps{step}{peak}: fp32 master "
                          f"weights changed {shares['master']:.1%} of the blocks' weights, float32 training "
                          f"{shares['fp32']:.1%}, pure bf16 {shares['pure']:.1%} "
                          f"({'keeps' if keeps else 'LOSES'} its updates)")



def _embedded_runs(c: Check) -> tuple[Path, list[str], list[str]]:
    """Where the embedded stage's runs go, the overrides every run takes, and the fine-tune's."""
    runs = c.out / "runs" if c.tiny else Path("/tmp/selfspec_device")
    common = ["eval_every=0", "save_every=0", "log_with=[jsonl]"]
    if c.tiny:
        return runs, common, ["optim.batch_size=2", "data.block_size=64", "early_exit.layers=[1,2]",
                              "exit_layer=2"]
    return runs, common, ["optim.batch_size=16", "data.block_size=512", "early_exit.layers=[4,5,6,8]",
                          "exit_layer=5", "mixed_precision=bf16"]


def _rounded_to_bf16(model_dir: Path, out: Path) -> Path:
    """A copy of a checkpoint with its weights rounded to bf16 and stored in float32: the weights a bf16
    run starts from, for a float32 run to start from too."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model_dir, out)
    for f in out.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16).float().contiguous() for k, v in load_file(f).items()}, f,
                  metadata={"format": "pt"})
    return out


def _step_ms(metrics: Path) -> str:
    """", N ms a step" from a run's metrics.jsonl (its steps' `minutes`), or "" with fewer than two."""
    minutes = [json.loads(line).get("minutes") for line in open(metrics)]
    minutes = [m for m in minutes if m is not None]
    if len(minutes) < 2:
        return ""
    return f", {(minutes[-1] - minutes[0]) * 60e3 / (len(minutes) - 1):.0f} ms a step"


def stage_zero2(c: Check) -> None:
    """DeepSpeed ZeRO-2 through accelerate (one process, `recipes/accelerate/zero2.yaml`): the embedded
    default's fine-tune for a few steps, where a DeepSpeed wheel built elsewhere imports (accelerate runs
    DeepSpeed on GPUs only). Its losses and step time, the saved model's share of changed weights."""
    runs, common, tune = _embedded_runs(c)
    base = runs / "base" / "model"
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001 - the verdict says why
        c.verdict("zero2", f"skipped: deepspeed does not import here ({type(e).__name__}: {str(e)[:200]})")
        return
    if not c.real_cuda:
        c.verdict("zero2", "skipped: no CUDA device (accelerate runs DeepSpeed on GPUs only)")
        return
    if not base.is_dir():
        c.verdict("zero2", "skipped: the embedded stage made no base model")
        return
    steps, out = 10, runs / "zero2"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                    str(ROOT / "selfspec" / "recipes" / "accelerate" / "zero2.yaml"), "--num_processes", "1",
                    "-m", "selfspec", "train", "--config", "demo_finetune", "--force", f"output_dir={out}",
                    f"model.name_or_path={base}", f"optim.max_steps={steps}", *tune, *common],
                   check=True, cwd=ROOT)
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl") if '"loss"' in line]
    c.verdict("zero2", f"deepspeed {deepspeed.__version__}, ZeRO-2, 1 process: {len(losses)} steps"
                       f"{_step_ms(out / 'metrics.jsonl')}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                       f"{_share_changed(base, out / 'model'):.1%} of the blocks' weights changed "
                       f"({time.perf_counter() - start:.0f} s with the launch)")


def _decode_tuned(c: Check, model_dir: Path, dtype: str, static: str | None) -> None:
    """The tuned model's early exit at its stored settings against its own plain decoding, one path."""
    from selfspec.checkpoint import load_tuned
    new, repeats = (8, 1) if c.tiny else (96, 2)
    gen = load_tuned(str(model_dir), device="cpu" if c._move else c.device, dtype=dtype, static_passes=static)
    if c._move is not None:
        c.move(gen.model)
    ids = [gen.tokenizer(p)["input_ids"] for p in _stdlib_prompts(2)]
    plain = lambda i: gen.generate([i], max_new_tokens=new, num_speculations=0, eos_token_id=[])
    spec = lambda i: gen.generate([i], max_new_tokens=new, eos_token_id=[])
    same = all(plain(i).sequences == spec(i).sequences for i in ids)
    outs = [spec(i).stats for i in ids]
    alpha = sum(o.accepted for o in outs) / max(sum(o.drafted for o in outs), 1)
    plain_s = sum(_timed(c, lambda i=i: plain(i), repeats) for i in ids)
    spec_s = sum(_timed(c, lambda i=i: spec(i), repeats) for i in ids)
    s, tokens = gen.settings, new * len(ids)
    c.verdict("embedded", f"{dtype} {'static passes, ' + static if static else 'eager'}, E={s.exit_layer} "
                          f"k={s.num_speculations}: {'lossless' if same else 'NOT lossless'} against its own "
                          f"plain; alpha {alpha:.3f}; plain {tokens / plain_s:.0f} tok/s, early exit "
                          f"{tokens / spec_s:.0f} tok/s: {plain_s / spec_s:.2f}x plain")


def _stdlib_prompts(n: int) -> list[str]:
    """The openings of n standard-library modules (the embedded default's own domain)."""
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f for f in ("argparse.py", "json/decoder.py", "textwrap.py", "dataclasses.py")]
    return [f.read_text()[:400] for f in files[:n]]


STAGE_FUNCTIONS = {"env": stage_env, "lossless": stage_lossless, "shapes": stage_shapes,
                   "graphs": stage_graphs, "embedded": stage_embedded, "zero2": stage_zero2}


# -- the driver ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for verdicts.txt and each stage's log")
    p.add_argument("--only", help="comma-separated stages (default: all, in order)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: the dry run")
    p.add_argument("--stage", help=argparse.SUPPRESS)  # run one stage in this process
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        STAGE_FUNCTIONS[args.stage](Check(out, args.tiny))
        return 0
    stages = args.only.split(",") if args.only else list(STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"unknown stage {unknown[0]!r}: choose among {', '.join(STAGES)}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           # transformers' own loads (Hugging Face's peers) would fetch hub kernels: there is no hub here
           "USE_HUB_KERNELS": "NO"}
    if Check(out, args.tiny).real_cuda:  # selfspec's CPU kernels serve no pass on a GPU: skip their build
        env.setdefault("SELFSPEC_KERNELS", "0")
    start, failed = time.perf_counter(), 0
    for name in stages:
        t = time.perf_counter()
        limit = min(STAGES[name], int(BUDGET - (t - start)))
        if limit < MIN_SECONDS.get(name, 5):
            Check(out, args.tiny).verdict(name, "stage SKIPPED: no time left of the 8 minutes")
            failed += name not in OPTIONAL
            continue
        with open(out / f"{name}.log", "w") as log:
            command = [sys.executable, __file__, "--out", str(out), "--stage", name,
                       *(["--tiny"] if args.tiny else [])]
            # a session of its own: at the limit the stage goes with everything it started (a launcher's
            # workers, a pretraining), not left on the GPU beside the next stage or a rerun
            stage = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
            try:
                rc = stage.wait(timeout=limit)
                status = "ok" if rc == 0 else f"FAILED (exit {rc}, see {name}.log)"
            except subprocess.TimeoutExpired:
                os.killpg(stage.pid, signal.SIGKILL)
                stage.wait()
                status = f"TIMED OUT at {limit} s"
        failed += status != "ok"
        Check(out, args.tiny).verdict(name, f"stage {status} in {time.perf_counter() - t:.0f} s")
    Check(out, args.tiny).verdict("total", f"{time.perf_counter() - start:.0f} s, {failed} stage(s) not ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
