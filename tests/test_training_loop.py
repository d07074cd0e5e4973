"""The accelerate loop end to end on a tiny model: smoke run, resume, LoRA, the objective's exits."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import CHATML, tiny_model
from transformers import AutoModelForCausalLM

from selfspec.agreement import shifted_labels
from selfspec.checkpoint import read_meta
from selfspec.config import EarlyExitConfig, load_config
from selfspec.errors import UserError
from selfspec.model import DecoderView
from selfspec.training.early_exit import TrimmedVocab
from selfspec.training.layer_dropout import LayerDropout
from selfspec.training.loop import _set_cpu_threads, train, train_or_reuse
from selfspec.training.objective import SelfSpecObjective

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port nobody listens on: each 2-process run gets its own rendezvous (a fixed port can still
    be held by the previous run's socket)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_config(tiny_run, out, *extra):
    return load_config(None, [
        f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
        f"data.cache_dir={out}/cache", "data.block_size=32", "data.max_eval_blocks=4",
        "optim.batch_size=4", "optim.max_steps=2", "optim.warmup_steps=1", f"output_dir={out}",
        "early_exit.layers=all", "layer_dropout.p_max=0.2", "eval_every=1", "save_every=0", "exit_layer=2",
        *extra])


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_two_step_smoke_run_writes_a_loadable_tuned_checkpoint(tiny_run, tmp_path):
    result = train(run_config(tiny_run, tmp_path), progress=False)
    assert result.steps == 2
    meta = read_meta(result.model_dir)
    assert meta["exit_layer"] == 2 and meta["kind"] == "tuned"
    assert "val/top1_agreement@2" in meta["metrics"] and meta["metrics"]["steps"] == 2
    assert set(losses(tmp_path)) == {1, 2}
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert model.config.num_hidden_layers == 4
    assert (result.model_dir / "tokenizer.json").is_file()
    # the training data's token frequencies, the ranking of a trimmed draft head
    from selfspec.checkpoint import read_token_counts

    counts = read_token_counts(result.model_dir)
    assert counts.shape == (model.config.vocab_size,) and meta["token_counts"]["tokens"] == counts.sum() > 0


def test_the_curve_starts_at_the_untuned_model_and_follows_every_evaluation(tiny_run, tmp_path):
    from selfspec.cli import main
    from selfspec.evaluation.curves import read_curve

    train(run_config(tiny_run, tmp_path, "optim.max_steps=3", "eval_every=2"), progress=False)
    curve = read_curve(tmp_path)
    assert curve["steps"] == [0, 2, 3] and curve["tokens"] == [0, 2 * 4 * 32, 3 * 4 * 32]
    assert set(curve["exits"]) == {1, 2, 3} and len(curve["exits"][2]["top1_agreement"]) == 3
    assert curve["minutes"][0] == 0.0 and curve["minutes"][1] <= curve["minutes"][2]
    assert main(["eval", "curve", str(tmp_path)]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 0 and (tmp_path / "curve.json").is_file()
    other = tmp_path / "other"
    train(run_config(tiny_run, other, "optim.max_steps=2", "eval_every=1", "layer_dropout.p_max=0.0"),
          progress=False)
    out = tmp_path / "recipes.png"
    # exit 2 from selfspec.json
    assert main(["eval", "curve", str(tmp_path), str(other), "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    assert main(["eval", "curve", str(tmp_path), str(other), "--exit-layer", "4", "--out", str(out)]) == 2


def test_resume_reproduces_an_uninterrupted_run(tiny_run, tmp_path):
    full = tmp_path / "full"
    train(run_config(tiny_run, full, "optim.max_steps=6", "save_every=3", "eval_every=0"), progress=False)
    reference = losses(full)
    assert set(reference) == {1, 2, 3, 4, 5, 6}
    # The state saved at step 3 is where an interrupted run would restart.
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    train(run_config(tiny_run, resumed, "optim.max_steps=6", "save_every=3", "eval_every=0"), resume=True,
          progress=False)
    # metrics.jsonl: the rows after the saved step 3 replaced by the resumed run's, each step once, the
    # wall clock going on from the state's
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    minutes = [r["minutes"] for r in rows if "loss" in r]
    assert minutes == sorted(minutes) and minutes[3] > minutes[2] > 0
    assert all(r["step_seconds"] > 0 and r["tokens_per_second"] > 0 and 0 <= r["layer_dropout"] <= 1
               for r in rows if "loss" in r)
    # each exit's training loss beside their weighted sum
    assert all(any(key.startswith("exit_loss@") and value > 0 for key, value in r.items())
               for r in rows if "loss" in r)
    again = {r["step"]: r["loss"] for r in rows if "loss" in r}
    for step in (4, 5, 6):
        assert again[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), step


def test_wandb_logs_online_whenever_wandb_is_logged_in(tmp_path, monkeypatch):
    """Credentials from WANDB_API_KEY or from ~/.netrc (what `wandb login` writes) count; none: offline."""
    from selfspec.training.loop import wandb_logged_in

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    assert not wandb_logged_in()
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password key\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_logged_in()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    assert not wandb_logged_in()
    monkeypatch.setenv("WANDB_API_KEY", "key")
    assert wandb_logged_in()


def test_mixed_lengths_train_every_other_micro_batch_on_short_blocks_and_resume_in_step(tiny_run, tmp_path,
                                                                                         monkeypatch):
    seen = []
    forward = SelfSpecObjective.forward

    def spy(self, input_ids, **kwargs):
        if self.training:
            seen.append((tuple(input_ids.shape), input_ids.flatten().tolist()))
        return forward(self, input_ids, **kwargs)

    monkeypatch.setattr(SelfSpecObjective, "forward", spy)
    mixed = ("data.short_block_size=8", "optim.max_steps=4", "eval_every=0", "save_every=2")
    train(run_config(tiny_run, tmp_path / "mixed", *mixed), progress=False)
    # block_size 32, batch 4: long steps see (4, 32), short ones the same 128 tokens as (16, 8)
    assert [shape for shape, _ in seen] == [(4, 32), (16, 8)] * 2
    mixed_tokens = [tokens for _, tokens in seen]
    seen.clear()
    train(run_config(tiny_run, tmp_path / "whole", "optim.max_steps=4", "eval_every=0", "save_every=0"),
          progress=False)
    assert [shape for shape, _ in seen] == [(4, 32)] * 4
    assert mixed_tokens == [tokens for _, tokens in seen]  # the same data in the same order, only cut
    # a resume from step 2 goes on with a long step, then a short one, as the whole run did
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "mixed", resumed)
    seen.clear()
    train(run_config(tiny_run, resumed, *mixed), resume=True, progress=False)
    assert [shape for shape, _ in seen] == [(4, 32), (16, 8)]


def test_resume_without_state_is_a_clear_error(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="no saved state"):
        train(run_config(tiny_run, tmp_path), resume=True, progress=False)


def test_lora_run_saves_merged_weights_equal_to_the_adapter_model(tiny_run, tmp_path):
    from peft import LoraConfig, get_peft_model

    from selfspec.checkpoint import save_tuned
    from selfspec.decoding import DecodeSettings

    base = tiny_model("llama", num_layers=4)
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 init_lora_weights=False))  # random B: adapters change logits
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        adapter_logits = peft_model(input_ids=ids).logits
    save_tuned(tmp_path / "merged", peft_model, settings=DecodeSettings(exit_layer=2))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (merged(ids).logits - adapter_logits).abs().max().item() < 1e-5
    assert not any("lora" in name for name, _ in merged.named_parameters())

    result = train(run_config(tiny_run, tmp_path / "run", "lora.enabled=true", "lora.r=4",
                              "early_exit.teacher=frozen"), progress=False)
    assert read_meta(result.model_dir)["exit_layer"] == 2


def test_lora_with_unknown_target_modules_is_a_clear_error(tiny_run, tmp_path):
    with pytest.raises(ValueError, match=r"lora.target_modules \['qkv'\] are not modules of this model"):
        train(run_config(tiny_run, tmp_path, "lora.enabled=true", "lora.target_modules=[qkv]"),
              progress=False)


def test_draft_only_training_changes_the_draft_blocks_and_nothing_else(tiny_run, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    result = train(run_config(tiny_run, tmp_path, "trainable=draft", "early_exit.layers=2",
                              "early_exit.final_weight=0", "layer_dropout.p_max=0", "optim.lr=1e-2"),
                   progress=False)
    tuned = AutoModelForCausalLM.from_pretrained(result.model_dir)
    before, after = base.state_dict(), tuned.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    draft_blocks = ("model.layers.0.", "model.layers.1.")
    assert changed and all(name.startswith(draft_blocks) for name in changed), changed


def test_final_weight_zero_runs_the_blocks_behind_the_exit_without_autograd():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    objective = SelfSpecObjective(model, EarlyExitConfig(final_weight=0.0), exit_layers=[2])
    out = objective(ids)
    out["loss"].backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(grads[n] is None for n in grads if n.startswith(("model.layers.2.", "model.layers.3.")))
    assert grads["model.layers.1.mlp.down_proj.weight"].abs().sum() > 0
    assert out["loss"].item() == pytest.approx(out["exit_loss"].item())  # the final CE is logged, not trained
    assert out["final_ce"].item() > 0


def test_a_run_cut_short_by_max_minutes_is_never_reused(tiny_run, tmp_path):
    cfg = run_config(tiny_run, tmp_path, "optim.max_minutes=1e-9", "eval_every=0")
    model_dir, reused = train_or_reuse(cfg, progress=False)
    assert not reused and read_meta(model_dir)["metrics"]["steps"] < cfg.optim.max_steps
    assert train_or_reuse(cfg, progress=False)[1] is False  # trained again, not taken from the cache


def test_exit_loss_at_layer_l_is_computed_on_block_l_minus_1_output():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    for layer in (1, 2, 3):
        objective = SelfSpecObjective(model, EarlyExitConfig(kind="ce"), exit_layers=[layer]).eval()
        with torch.no_grad():
            got = objective(ids)["exit_loss"]
            hidden = model(ids, output_hidden_states=True).hidden_states[layer]  # output of block layer-1
            logits = model.lm_head(model.model.norm(hidden))
            expected = F.cross_entropy(logits.flatten(0, 1), shifted_labels(ids).flatten(), ignore_index=-100)
        assert got.item() == pytest.approx(expected.item(), rel=1e-5), layer


def test_the_objective_reads_the_early_exit_section():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    section = EarlyExitConfig(layers=[1, 3], kind="ce", weight=0.5, curriculum="rotational",
                              rotation_period=2)
    objective = SelfSpecObjective(model, section).eval()
    assert objective.exit_layers == [1, 3] and objective.curriculum.active(0) == [1]
    assert objective.curriculum.active(1) == [3]
    with torch.no_grad():
        out = objective(ids, step=1)  # only layer 3 is active at step 1
        alone = SelfSpecObjective(model, EarlyExitConfig(kind="ce"), exit_layers=[3]).eval()(ids)
    torch.testing.assert_close(out["exit_loss"], alone["exit_loss"])
    torch.testing.assert_close(out["loss"], out["final_ce"] + 0.5 * out["exit_loss"])
    assert SelfSpecObjective(model, EarlyExitConfig(layers=None)).exit_layers == []
    with pytest.raises(UserError, match="teacher = 'frozen' needs frozen_model"):
        SelfSpecObjective(model, EarlyExitConfig(layers=2, teacher="frozen"))


def test_fault_injection_is_one_hook_that_fires_only_at_its_point(monkeypatch):
    import os
    import signal

    from selfspec.files import FAULT_ENV, fault_point

    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.delenv(FAULT_ENV, raising=False)
    fault_point("saving:4")
    monkeypatch.setenv(FAULT_ENV, "saving:4")
    fault_point("saving:2"), fault_point("saved:4")
    assert killed == []
    fault_point("saving:4")
    assert killed == [(os.getpid(), signal.SIGKILL)]


def test_objective_without_extras_is_the_plain_causal_lm_loss():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        expected = model(ids, labels=ids).loss
        got = SelfSpecObjective(model)(ids)["loss"]
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


def test_nothing_is_dropped_in_eval_mode():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(0, 96, (2, 10))
    heavy = LayerDropout(4, p_max=0.9, depth="uniform", per_sample=False, seed=0)
    objective = SelfSpecObjective(model, exit_layers=[2], layer_dropout=heavy, total_steps=10)
    reference = SelfSpecObjective(model, exit_layers=[2])
    objective.eval(), reference.eval()
    with torch.no_grad():
        assert objective(ids)["loss"].item() == reference(ids)["loss"].item()
        objective.train()
        assert objective(ids)["loss"].item() != reference(ids)["loss"].item()


@pytest.mark.slow
def test_two_step_run_through_accelerate_launch(tiny_run, tmp_path):
    cfg_overrides = [
        f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
        f"data.cache_dir={tmp_path}/cache", "data.block_size=32", "data.max_eval_blocks=4",
        "optim.batch_size=4", "optim.max_steps=2", f"output_dir={tmp_path}", "early_exit.layers=2:4",
        "layer_dropout.p_max=0.2", "exit_layer=2"]
    # --multi_gpu on a machine without GPUs: torchrun starts 2 processes, the loop picks gloo on CPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()),
           "-m", "selfspec", "train", "--config", "demo_finetune", *cfg_overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_meta(tmp_path / "model")["metrics"]["processes"] == 2


def test_token_fraction_subsamples_the_same_positions_for_every_exit():
    model = tiny_model("llama", num_layers=4)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    full = SelfSpecObjective(model, EarlyExitConfig(layers="1:4", kind="ce")).eval()
    part = SelfSpecObjective(model, EarlyExitConfig(layers="1:4", kind="ce", token_fraction=0.25),
                             seed=3).eval()
    assert full.exit_layers == part.exit_layers == [1, 2, 3]  # early_exit.layers, parsed against the depth
    with torch.no_grad():
        a, b = part(ids, step=5)["exit_loss"], part(ids, step=5)["exit_loss"]
        assert a.item() == b.item()  # a pure function of (seed, step): resume draws the same positions
        assert part(ids, step=6)["exit_loss"].item() != a.item()  # fresh positions each step
        # The mean over many steps approaches the full-token loss (an unbiased estimate).
        mean = sum(part(ids, step=s)["exit_loss"].item() for s in range(200)) / 200
        assert mean == pytest.approx(full(ids)["exit_loss"].item(), rel=0.03)


def test_cpu_threads_under_accelerate_launch_use_the_cores_and_an_explicit_count_wins(monkeypatch):
    """`accelerate launch` leaves one thread per CPU process; the loop gives each its share of cores."""
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
        torch.set_num_threads(1)
        _set_cpu_threads(None, 1)  # in-process caller: its own setting stays
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
        monkeypatch.setattr("os.cpu_count", lambda: 8)
        _set_cpu_threads(None, 2)
        assert torch.get_num_threads() == 4
        _set_cpu_threads(3, 2)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_two_machines_on_localhost_match_one_process(tiny_run, tmp_path):
    """The shipped multinode.yaml as two `accelerate launch` commands, machine ranks 0 and 1 on
    127.0.0.1 with one process each (static rendezvous; gloo on CPUs, fp32): each machine with its own
    cache and output directory, as on two disks. Machine 0's run equals one process at the same global
    batch (losses within rel 1e-5, weights within atol 1e-5)."""
    from selfspec.recipes import find

    common = [f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
              "data.block_size=32", "data.max_eval_blocks=4", "optim.max_steps=3", "optim.warmup_steps=1",
              "early_exit.layers=2:4", "early_exit.token_fraction=1.0", "layer_dropout.p_max=0.3",
              "layer_dropout.per_sample=false",
              "exit_layer=2", "eval_every=1", "save_every=0", "log_with=[jsonl]"]
    single = tmp_path / "single"
    train(load_config("demo_finetune", [*common, "optim.batch_size=4", f"data.cache_dir={tmp_path}/cache",
                                        f"output_dir={single}"]), progress=False)
    port = str(free_port())
    machines = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(find("accelerate/multinode")), "--num_machines", "2", "--num_processes", "2",
               "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port,
               "--mixed_precision", "no", "-m", "selfspec", "train", "--config", "demo_finetune", *common,
               "optim.batch_size=2", f"data.cache_dir={tmp_path}/cache{rank}",
               f"--output-dir={tmp_path}/machine{rank}"]
        machines.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         cwd=tmp_path))
    for proc in machines:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]

    def curve(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {(r["step"], key): r[key] for r in rows for key in ("loss", "val/loss") if key in r}

    one, two = curve(single), curve(tmp_path / "machine0")
    assert set(one) == set(two) and {(s, "loss") for s in (1, 2, 3)} <= set(one)
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-5), key
    reference = AutoModelForCausalLM.from_pretrained(single / "model").state_dict()
    machine0 = AutoModelForCausalLM.from_pretrained(tmp_path / "machine0" / "model").state_dict()
    for name, value in machine0.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_at_the_same_global_batch_and_resumes_on_one(tiny_run, tmp_path):
    """2 gloo processes × 2 blocks == 1 process × 4 blocks, with per-batch layer dropout and exit losses.

    Same data order (the seedable sampler's permutation, dealt out batch by batch), the same layer
    dropout draws (each process's generator is seeded alike), the same exit-loss positions (all of
    them: token_fraction 1). Tolerance: training and validation losses within rel 1e-5, final weights
    within atol 1e-5 (float sums in another order, through 4 AdamW steps). The 2-process run's state at
    step 2 then resumes on one process and ends where the 1-process run ended.
    """
    common = [f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
              "data.block_size=32", "data.max_eval_blocks=4", "optim.max_steps=4", "optim.warmup_steps=1",
              "early_exit.layers=2:4",
              "early_exit.token_fraction=1.0", "layer_dropout.p_max=0.3", "layer_dropout.per_sample=false",
              "exit_layer=2", "eval_every=1", "save_every=2", "log_with=[jsonl]"]
    recipe = "demo_finetune"  # both runs: this shipped recipe with the overrides above
    common.append(f"data.cache_dir={tmp_path}/cache")
    single = tmp_path / "single"
    train(load_config(recipe, [*common, "optim.batch_size=4", f"output_dir={single}"]), progress=False)
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()),
           str(REPO / "train" / "finetune.py"), "--config", str(recipe), *common, "optim.batch_size=2",
           f"output_dir={ddp}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]

    def curve(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        keys = ("loss", "val/loss", "val/loss@2")
        return {(r["step"], key): r[key] for r in rows for key in keys if key in r}

    one, two = curve(single), curve(ddp)
    assert set(one) == set(two) and {k for k in one if k[1] == "loss"} == {(s, "loss") for s in (1, 2, 3, 4)}
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-5), key

    def weights(model_dir):
        return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()

    reference = weights(single / "model")
    start = weights(tiny_run["model"])
    assert max(float((reference[n] - start[n]).abs().max()) for n in reference) > 100 * 1e-5  # it trained
    for name, value in weights(ddp / "model").items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)

    # The 2-process state at step 2, resumed by one process with the same global batch.
    resumed = tmp_path / "resumed"
    shutil.copytree(ddp, resumed)
    shutil.rmtree(resumed / "model")
    (resumed / "metrics.jsonl").write_text("")
    train(load_config(recipe, [*common, "optim.batch_size=4", f"output_dir={resumed}"]), resume=True,
          progress=False)
    assert {k for k in curve(resumed) if k[1] == "loss"} == {(3, "loss"), (4, "loss")}
    for name, value in weights(resumed / "model").items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_run_killed_anywhere_resumes_to_the_same_weights_bit_for_bit(tiny_run, tmp_path):
    """SIGKILL mid-step, during a state save (files written, pointer not yet) and right after one; each
    run resumed with --resume ends with weights bitwise equal to an uninterrupted run's. A half-written
    state is never taken for a complete one, and a finished run's directory is not overwritten."""
    import os

    from safetensors.torch import load_file

    from selfspec.files import FAULT_ENV
    from selfspec.training.loop import latest_state

    def run(out, *flags, fault=None):
        env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
        if fault:
            env[FAULT_ENV] = fault
        cmd = [sys.executable, str(REPO / "train" / "finetune.py"),
               "--config", "demo_finetune",
               f"model.name_or_path={tiny_run['model']}", f"data.source={tiny_run['corpus']}",
               "data.block_size=32", f"data.cache_dir={tmp_path}/cache", "data.max_eval_blocks=4",
               "optim.batch_size=4", "optim.max_steps=6", "optim.warmup_steps=1", "early_exit.layers=2:4",
               "exit_layer=2", "layer_dropout.p_max=0.3",
               "eval_every=0", "save_every=2", "log_with=[jsonl]", f"output_dir={out}", *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)

    reference = tmp_path / "reference"
    assert run(reference).returncode == 0
    weights = load_file(reference / "model" / "model.safetensors")

    for fault, restart_step in (("mid_step:3", 2), ("saving:4", 2), ("saved:4", 4)):
        out = tmp_path / fault.replace(":", "-")
        killed = run(out, fault=fault)
        assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL
        assert not (out / "model").exists()
        saved = latest_state(out / "state")
        assert saved is not None and json.loads((saved / "progress.json").read_text())["step"] == restart_step
        if fault.startswith("saving"):  # the new state's files are all there, yet it is not the latest
            assert (out / "state" / "step-00000004" / "progress.json").is_file()
        resumed = run(out, "--resume")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert losses(out).keys() >= set(range(restart_step + 1, 7))
        again = load_file(out / "model" / "model.safetensors")
        assert again.keys() == weights.keys()
        for name in weights:
            assert torch.equal(again[name], weights[name]), (fault, name)

    # a finished run is not overwritten by a fresh one: one error line, exit status 2, nothing changed
    before = (reference / "model" / "model.safetensors").read_bytes()
    again = run(reference)
    assert again.returncode == 2 and "holds a previous run" in again.stderr and "--resume" in again.stderr
    assert (reference / "model" / "model.safetensors").read_bytes() == before
    assert run(reference, "--force").returncode == 0  # unless asked to


# --- chat data and the trimmed exit loss -------------------------------------------------------------



@pytest.fixture(scope="module")
def chat_run(tiny_run, tmp_path_factory):
    """The tiny model with a chat template, and a .jsonl of conversations."""
    root = tmp_path_factory.mktemp("chat_run")
    model = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    tokenizer = tiny_run["tokenizer"]
    tokenizer_copy = type(tokenizer).from_pretrained(tiny_run["model"])
    tokenizer_copy.chat_template = CHATML
    model.save_pretrained(root / "model")
    tokenizer_copy.save_pretrained(root / "model")
    corpus = root / "chat.jsonl"
    rows = [{"id": f"c{i}", "prompt": f"what does f({i}) return?",
             "response": f"def f(x):\n    return x + {i}"} for i in range(120)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": root / "model", "corpus": corpus}


def test_shifted_labels_keep_only_positions_whose_next_token_is_a_target():
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[False, True, True, False]])
    assert shifted_labels(ids, mask).tolist() == [[6, 7, -100, -100]]
    assert shifted_labels(ids).tolist() == [[6, 7, 8, -100]]


def test_a_chat_run_with_the_trimmed_exit_loss_trains_and_stores_its_draft_vocabulary(chat_run, tmp_path):
    cfg = load_config(None, [
        f"model.name_or_path={chat_run['model']}", f"data.source={chat_run['corpus']}",
        f"data.cache_dir={tmp_path}/cache", "data.block_size=64", "data.max_eval_blocks=2",
        "optim.batch_size=2", "optim.max_steps=3", "optim.warmup_steps=1", f"output_dir={tmp_path}",
        "early_exit.layers=1,2", "early_exit.draft_vocab_size=64", "early_exit.kind=argmax",
        "layer_dropout.p_max=0.2", "eval_every=1", "save_every=0", "exit_layer=2", "choose_exit=true"])
    result = train(cfg, progress=False)
    meta = read_meta(result.model_dir)
    assert meta["draft_vocab_size"] == 64
    choice = meta["exit_choice"]
    assert set(choice["candidates"]) == {"1", "2"} and meta["exit_layer"] == choice["exit_layer"]
    for layer, row in choice["candidates"].items():
        assert row["acceptance_rate"] == meta["metrics"][f"val/top1_agreement@{layer}"]
    assert meta["num_speculations"] == choice["num_speculations"]
    assert all(math.isfinite(v) for v in losses(tmp_path).values())


def test_the_objective_limits_every_loss_to_the_target_tokens():
    model = tiny_model("llama", num_layers=4)
    vocab = TrimmedVocab(torch.arange(50), 96)
    objective = SelfSpecObjective(model, exit_layers=[2], exit_vocab=vocab).train()
    ids = torch.randint(0, 96, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[:, 6:] = True
    out = objective(ids, target_mask=mask)
    changed = ids.clone()
    # tokens that are no target and whose position predicts none
    changed[:, :6] = torch.randint(0, 96, (2, 6))
    changed[:, 5] = ids[:, 5]  # position 5 predicts token 6, a target; keep it
    logits = DecoderView(model)(ids)
    expected = F.cross_entropy(logits[:, 5:-1].flatten(0, 1), ids[:, 6:].flatten())
    torch.testing.assert_close(out["final_ce"], expected)
    out["loss"].backward()
    assert objective.other_row.grad is not None and objective.other_row.grad.abs().sum() > 0


def test_draft_mask_limits_the_exit_losses_and_leaves_the_final_loss_alone():
    """`early_exit.skip_forced`: the exit losses count only the drafted targets (`draft_mask`); the
    final layer's CE keeps every target."""
    model = tiny_model("llama", num_layers=4)
    objective = SelfSpecObjective(model, exit_layers=[2]).train()
    ids = torch.randint(0, 96, (2, 12))
    target = torch.ones(2, 12, dtype=torch.bool)
    drafted = target.clone()
    drafted[:, 3:8] = False  # tokens a grammar forced
    full, skipped = objective(ids, target_mask=target), objective(ids, target_mask=target, draft_mask=drafted)
    torch.testing.assert_close(skipped["final_ce"], full["final_ce"])
    assert not torch.allclose(skipped["exit_loss"], full["exit_loss"])
    # the same as a batch whose only targets are the drafted ones, for the exit
    torch.testing.assert_close(skipped["exit_loss"], objective(ids, target_mask=drafted)["exit_loss"])


@pytest.mark.parametrize("trainable", ["all", "adapter"])
def test_a_run_on_constrained_replies_skips_the_forced_tokens(chat_run, tmp_path, trainable):
    """Rows carrying their json_schema: `early_exit.skip_forced` packs a draft_mask (the forced tokens
    left out), the loop passes it with the batches (also joined to cached exit features) and reports
    the exits' agreement on the drafted tokens."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
              "required": ["name", "count"], "additionalProperties": False}
    corpus = tmp_path / "constrained.jsonl"
    rows = [{"id": f"c{i}", "json_schema": schema, "messages": [
        {"role": "user", "content": f"name f{i}, count {i}"},
        {"role": "assistant", "content": json.dumps({"name": f"f{i}", "count": i})}]} for i in range(120)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = (["trainable=adapter", "adapter_kind=block", "layer_dropout.p_max=0.0"] if trainable == "adapter"
             else [])
    cfg = load_config(None, [
        f"model.name_or_path={chat_run['model']}", f"data.source={corpus}",
        f"data.cache_dir={tmp_path}/cache", "data.block_size=64", "data.max_eval_blocks=2",
        "optim.batch_size=2", "optim.max_steps=2", "optim.warmup_steps=1", f"output_dir={tmp_path}/run",
        "early_exit.layers=2", "early_exit.skip_forced=true", "eval_every=1", "save_every=0", "exit_layer=2",
        *extra])
    metrics = read_meta(train(cfg, progress=False).model_dir)["metrics"]
    assert 0 <= metrics["val/drafted/top1_agreement@2"] <= 1
    assert metrics["val/drafted/top1_agreement@2"] != metrics["val/top1_agreement@2"]
    plain = tmp_path / "plain.jsonl"  # replies without their schema: nothing says which were forced
    plain.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "json_schema"}) + "\n"
                             for r in rows))
    with pytest.raises(UserError, match="skip_forced needs replies with their json_schema"):
        train(load_config(None, [f"model.name_or_path={chat_run['model']}", f"data.source={plain}",
                                 "early_exit.skip_forced=true", f"output_dir={tmp_path}/refused"]),
              progress=False)
    assert not (tmp_path / "refused" / "model").exists()


# --- the exit adapter --------------------------------------------------------------------------------

def test_an_adapter_run_trains_only_the_adapter_and_decoding_stays_the_models_own(tiny_run, tmp_path):
    from selfspec.checkpoint import load_tuned
    from selfspec.model.exit_adapter import ADAPTER_FILE

    cfg = run_config(tiny_run, tmp_path, "trainable=adapter", "layer_dropout.p_max=0.0",
                     "early_exit.layers=2", "optim.max_steps=3", "optim.lr=1e-2", "early_exit.kind=argmax")
    result = train(cfg, progress=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    tuned = AutoModelForCausalLM.from_pretrained(result.model_dir)
    for (name, a), b in zip(base.state_dict().items(), tuned.state_dict().values()):
        assert torch.equal(a, b), name  # the model itself is untouched: the gate shows 0.0%
    meta = read_meta(result.model_dir)
    assert meta["exit_adapter"]["exit_layer"] == 2 and (result.model_dir / ADAPTER_FILE).is_file()
    generator = load_tuned(result.model_dir)
    adapter = generator.draft_head().adapter
    assert adapter is not None and adapter.down.weight.abs().sum() > 0  # trained away from the identity
    # another E: the plain exit
    assert load_tuned(result.model_dir, exit_layer=1).draft_head().adapter is None
    # The validation agreement (the loop's and `selfspec layers`') is the draft's: through the adapter.
    from selfspec.commands import LayersOptions, layers_report

    held_out = dict(data=str(tiny_run["corpus"]), split="validation", block_size=32, max_blocks=4)
    report = layers_report(LayersOptions(model=str(result.model_dir), **held_out))
    assert report[2]["loss"] == pytest.approx(meta["metrics"]["val/loss@2"], rel=1e-5)
    raw = layers_report(LayersOptions(model=str(tiny_run["model"]), **held_out))
    assert raw[2]["loss"] != pytest.approx(report[2]["loss"], rel=1e-3)
    prompt = tiny_run["tokenizer"]("def f(x):")["input_ids"]
    out = generator.generate([prompt], max_new_tokens=12, num_speculations=3, eos_token_id=[])
    plain = tuned.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out.sequences[0] == plain[0, len(prompt):].tolist()


def test_an_exit_block_copied_from_a_block_the_model_lacks_is_refused(tiny_run, tmp_path):
    cfg = run_config(tiny_run, tmp_path, "trainable=adapter", "adapter_kind=block", "adapter_init_layer=4",
                     "layer_dropout.p_max=0.0", "early_exit.layers=2")
    with pytest.raises(UserError, match=r"adapter_init_layer = 4 is not a block of the model's 4"):
        train(cfg, progress=False)
    assert not (tmp_path / "model").exists()
    cfg = run_config(tiny_run, tmp_path, "trainable=adapter", "adapter_kind=block", "adapter_init_layer=1",
                     "adapter_blocks=3", "layer_dropout.p_max=0.0", "early_exit.layers=2")
    with pytest.raises(UserError, match=r"adapter_blocks = 3 copies more blocks than the 2 up to block 1"):
        train(cfg, progress=False)
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("override, message", [
    ("layer_dropout.p_max=0.2", "layer dropout would change"),
    ("lora.enabled=true", "a LoRA on them cannot train"),
])
def test_adapter_training_refuses_what_would_move_the_frozen_model(tiny_run, tmp_path, override, message):
    from selfspec.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        run_config(tiny_run, tmp_path, "trainable=adapter", "layer_dropout.p_max=0.0", override)


# --- cached exit features and the exit block ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_the_cached_exit_loss_equals_the_live_one(kind):
    """Stored exit states and the teacher's argmax give the very loss (and gradient) that running the
    frozen model in the step gives, for both adapter kinds, over a trimmed vocabulary with "other"."""
    import datasets

    from selfspec.model.exit_adapter import new_exit_adapter
    from selfspec.training.features import compute_exit_features

    model = tiny_model("llama", num_layers=4).eval().requires_grad_(False)
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (3, 16))
    mask = torch.rand(3, 16) < 0.7
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "target_mask": mask.tolist()}
                                        ).with_format("torch")
    features = compute_exit_features(model, blocks, exit_layer=2, top_k=1, progress=False)
    assert torch.equal(features["target_mask"][:], mask)
    losses_and_grads = []
    for cached in (False, True):
        torch.manual_seed(1)
        adapter = new_exit_adapter(kind, model, 2).requires_grad_(True)
        if kind == "mlp":
            torch.nn.init.normal_(adapter.down.weight, std=0.1)
        objective = SelfSpecObjective(model, EarlyExitConfig(kind="argmax", teacher="self", final_weight=0.0),
                                      exit_layers=[2], exit_vocab=TrimmedVocab(torch.arange(40), 96),
                                      exit_adapter=adapter).train()
        batch = ({name: features[name][:] for name in ("exit_hidden", "teacher_ids", "teacher_probs")}
                 if cached else {"input_ids": ids})
        out = objective(**batch, target_mask=mask)
        out["loss"].backward()
        losses_and_grads.append((out["exit_loss"], [p.grad.clone() for p in adapter.parameters()]))
    (live, live_grads), (cached, cached_grads) = losses_and_grads
    torch.testing.assert_close(cached, live)
    for a, b in zip(cached_grads, live_grads):
        torch.testing.assert_close(a, b)


def test_features_are_computed_once_and_reused(tiny_run, tmp_path, monkeypatch):
    from selfspec.training import features as features_lib

    calls = []
    real = features_lib.compute_exit_features
    monkeypatch.setattr(features_lib, "compute_exit_features",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    computed = []
    for run in ("first", "second"):
        cfg = run_config(tiny_run, tmp_path / run, "trainable=adapter", "layer_dropout.p_max=0.0",
                         "early_exit.layers=2", f"data.cache_dir={tmp_path}/cache")
        train(cfg, progress=False)
        computed.append(len(calls))
    shards = len(list((tmp_path / "cache").glob("exit-features-*")))
    assert computed == [shards, shards] and shards >= 1  # the second run computed nothing
    # The curve counts the preparation as time spent: every point after the first lies beyond it.
    from selfspec.evaluation.curves import read_curve

    rows = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]
    prepared = next(r["feature_minutes"] for r in rows if "feature_minutes" in r)
    minutes = read_curve(tmp_path / "first")["minutes"]
    assert prepared > 0 and minutes[0] == 0.0 and all(m > prepared for m in minutes[1:])


def test_features_grow_shard_by_shard(tmp_path, monkeypatch):
    """More blocks (the same blocks first, as packing keeps order) compute only the shards they add,
    and the shards together equal one pass over all the blocks."""
    import datasets

    from selfspec.training import features as features_lib

    monkeypatch.setattr(features_lib, "SHARD_BLOCKS", 2)
    model = tiny_model("llama", num_layers=4).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (7, 12))
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist()}).with_format("torch")
    computed = []
    real = features_lib.compute_exit_features
    monkeypatch.setattr(features_lib, "compute_exit_features",
                        lambda model, part, *a, **k: computed.append(len(part)) or real(model, part, *a, **k))
    args = ("tiny", 2, 3, 1.0, tmp_path)
    features_lib.exit_features(model, blocks.select(range(5)), *args, progress=False)
    assert computed == [2, 2, 1]
    computed.clear()
    grown = features_lib.exit_features(model, blocks, *args, progress=False)
    assert computed == [2, 1]  # blocks 4-5 (the old last shard held only block 4) and block 6
    whole = real(model, blocks, 2, 3, 1.0, progress=False)
    assert len(grown) == 7
    for name in ("exit_hidden", "teacher_ids", "teacher_probs", "target_mask"):
        torch.testing.assert_close(grown[name][:], whole[name][:])


def test_an_exit_block_run_keeps_the_model_and_decodes_its_own_tokens(tiny_run, tmp_path):
    """adapter_kind: block: a copy of block 3 trained on cached features; the checkpoint names its kind
    and source block; load_tuned drafts through it with its own KV cache, the output is the model's."""
    from selfspec.checkpoint import load_tuned

    cfg = run_config(tiny_run, tmp_path, "trainable=adapter", "adapter_kind=block", "adapter_init_layer=3",
                     "layer_dropout.p_max=0.0", "early_exit.layers=2", "optim.max_steps=3", "optim.lr=1e-2")
    result = train(cfg, progress=False)
    base = AutoModelForCausalLM.from_pretrained(tiny_run["model"])
    tuned = AutoModelForCausalLM.from_pretrained(result.model_dir)
    for (name, a), b in zip(base.state_dict().items(), tuned.state_dict().values()):
        assert torch.equal(a, b), name
    meta = read_meta(result.model_dir)
    assert meta["exit_adapter"] == {"exit_layer": 2, "file": "exit_adapter.safetensors", "kind": "block",
                                    "init_layers": [3]}
    generator = load_tuned(result.model_dir)
    block = generator.exit_adapters[2]
    assert block.attends and generator.draft_head().adapter is None
    trained = block.layers[0].mlp.down_proj.weight
    assert not torch.equal(trained, DecoderView(base).layers[3].mlp.down_proj.weight)  # it trained
    prompt = tiny_run["tokenizer"]("def f(x):")["input_ids"]
    out = generator.generate([prompt], max_new_tokens=12, num_speculations=3, eos_token_id=[])
    plain = tuned.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out.sequences[0] == plain[0, len(prompt):].tolist()
    assert out.stats.early_exit.drafted > 0


def test_a_stack_of_exit_blocks_trains_and_an_old_one_block_checkpoint_still_loads(tiny_run, tmp_path):
    """adapter_blocks: 2 copies blocks 2 and 3 (ending at the last), records both, and decodes the
    model's own tokens; a checkpoint written before stacks ({init_layer}, weights under "layer.")
    loads as a one-block stack with the same weights."""
    from safetensors.torch import load_file, save_file

    from selfspec.checkpoint import load_tuned
    from selfspec.model.exit_adapter import ADAPTER_FILE, load_exit_adapter

    cfg = run_config(tiny_run, tmp_path / "stack", "trainable=adapter", "adapter_kind=block",
                     "adapter_blocks=2", "layer_dropout.p_max=0.0", "early_exit.layers=2",
                     "optim.max_steps=2")
    result = train(cfg, progress=False)
    assert read_meta(result.model_dir)["exit_adapter"]["init_layers"] == [2, 3]
    generator = load_tuned(result.model_dir)
    assert generator.exit_adapters[2].cache_layers == 2
    prompt = tiny_run["tokenizer"]("def f(x):")["input_ids"]
    out = generator.generate([prompt], max_new_tokens=12, num_speculations=3, eos_token_id=[])
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    plain = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out.sequences[0] == plain[0, len(prompt):].tolist()

    old = tmp_path / "old"
    old.mkdir()
    state = load_file(str(result.model_dir / ADAPTER_FILE))
    first = {f"layer.{name[len('layers.0.'):]}": value for name, value in state.items()
             if name.startswith("layers.0.")}
    save_file(first, str(old / ADAPTER_FILE))
    block = load_exit_adapter(old, {"kind": "block", "init_layer": 2}, model)
    assert block.init_layers == [2] and block.cache_layers == 1
    for name, value in block.state_dict().items():
        assert torch.equal(value, state[name]), name
