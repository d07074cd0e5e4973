"""The benchmark runs all its methods in one process, checks greedy identity, writes JSON + Markdown.

No timing is asserted: only that the figures are there and consistent.
"""

import json
from pathlib import Path

import pytest
from helpers import assert_shape, ranking_counts, tiny_model

from selfspec.decoding import DecodeSettings
from selfspec.evaluation.benchmark import run_benchmark, to_markdown, write_report
from selfspec.evaluation.options import BenchmarkRun
from selfspec.evaluation.results import BenchmarkReport
from selfspec.evaluation.timing import DEFAULT_METHODS, METHODS, LoadedCheckpoint

ROOT = Path(__file__).resolve().parents[1]



def test_benchmark_report(tmp_path):
    model = tiny_model("llama")
    repeats = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # copying finds matches
    settings = DecodeSettings(exit_layer=3, num_speculations=3, draft_vocab_size=48)
    checkpoint = LoadedCheckpoint(model, settings, token_counts=ranking_counts(range(48), 96))
    report = run_benchmark(checkpoint, [repeats, [9, 10]],
                           BenchmarkRun(max_new_tokens=10, repeats=2, warmup=1))
    assert set(report["methods"]) == set(DEFAULT_METHODS)
    assert_shape(report, BenchmarkReport)
    assert (report["settings"]["hybrid"]["draft_vocab_size"] == 48
            and report["settings"]["ngram"]["ngram"]["min_ngram"] == 2)
    assert all(len(m["tokens_per_second_all"]) == 2 for m in report["methods"].values())
    assert report["greedy_outputs_identical"]
    assert report["identical"]["hf_early_exit"]  # Hugging Face's self-speculation is lossless too
    assert report["identical"]["hf_prompt_lookup"]  # and so is its prompt lookup
    assert (report["speedups"]["early_exit_over_plain"] > 0
            and report["speedups"]["hybrid_over_hf_prompt_lookup"] > 0)
    sources = report["sources"]
    assert sources["ngram"]["copy"]["drafted"] > 0 and sources["ngram"]["early_exit"]["drafted"] == 0
    assert (sources["early_exit"]["copy"]["drafted"] == 0
            and sources["early_exit"]["early_exit"]["drafted"] > 0)
    assert sources["hybrid"]["copy"]["drafted"] > 0 and sources["hybrid"]["early_exit"]["drafted"] > 0
    prefill = report["prefill"]  # the engine's methods, each split at its first round
    assert prefill.keys() == {"plain", "early_exit", "ngram", "hybrid"}
    assert prefill["plain"]["decode_over_plain"] == 1
    assert all(0 < row["share"] < 1 and row["decode_tokens_per_second"] > 0 for row in prefill.values())
    cost = report["cost_model"]
    assert 0 < cost["acceptance_rate"] <= 1 and cost["mean_accepted_length"] >= 1
    assert cost["k_rounds"].keys() == {3} and cost["mean_k"] == 3
    assert cost["predicted_speedup"] > 0 and cost["measured_over_predicted"] > 0 and cost["draft_cost"] > 0
    # each method against plain in the same repeats: plain's own ratio is exactly 1
    assert report["methods"]["plain"]["over_plain"]["speedup"] == 1.0
    assert all(m["over_plain"]["low"] <= m["over_plain"]["speedup"] <= m["over_plain"]["high"]
               for m in report["methods"].values())
    json_path, md_path = write_report(report, tmp_path)
    assert json.loads(json_path.read_text())["settings"]["early_exit"]["exit_layer"] == 3
    text = md_path.read_text()
    assert "early_exit / plain" in text and "acceptance_rate" in text and "Greedy outputs identical" in text
    assert "| hybrid | copy |" in text and "hybrid / hf_prompt_lookup" in text
    assert "| plain | " in text and "decoding × plain" in text
    assert "hybrid, E = 3, k = 3, V' = 48, min_ngram = 2" in text


def test_the_prefill_split_pools_each_methods_runs_and_compares_their_decoding_with_plains():
    """Plain: 4 s of 10 in its prefills, 120 tokens in the other 6 s (20/s); the drafter: the same
    prefills, 120 tokens in 3 s (40/s): 2× plain after the prefill, 10/7 = 1.43× end to end."""
    from selfspec.decoding.speculative import GenerationStats
    from selfspec.evaluation.costs import prefill_split

    def run(prefill, total, tokens):
        return GenerationStats(prefill_time=prefill, total_time=total, generated_tokens=tokens)

    split = prefill_split({"plain": [run(1.0, 4.0, 60), run(3.0, 6.0, 60)],
                           "hybrid": [run(1.0, 2.5, 60), run(3.0, 4.5, 60)]})
    assert split["plain"] == pytest.approx({"share": 0.4, "decode_tokens_per_second": 20.0,
                                            "decode_over_plain": 1.0})
    assert split["hybrid"] == pytest.approx({"share": 4 / 7, "decode_tokens_per_second": 40.0,
                                             "decode_over_plain": 2.0})
    assert prefill_split({"hybrid": [run(0.0, 1.0, 5)]}) == {}  # no prefill timed: nothing to split


def test_a_losing_early_exit_is_explained_in_one_paragraph():
    """The benchmark ends with the doctor's checklist, from its own figures, in the doctor's words."""
    from selfspec.evaluation.benchmark import diagnosis
    from selfspec.evaluation.diagnosis import DRAFT_COST_MARGIN
    from selfspec.metrics import break_even_acceptance

    cost = {"acceptance_rate": 0.76, "mean_k": 2.0, "k_rounds": {2: 10}, "draft_cost": 0.55,
            "verify_cost": 1.47, "weight_cost": 0.55 / (DRAFT_COST_MARGIN + 0.1)}
    losing = {"settings": {"early_exit": {"exit_layer": 4}},
              "methods": {"plain": {}, "early_exit": {"over_plain": {"speedup": 0.96}},
                          "ngram": {"over_plain": {"speedup": 1.20}}},
              "cost_model": cost,
              "round_profile": {"methods": {"early_exit": {"plain_steps": {"outside_passes": 0.3}}}}}
    text = diagnosis(losing)
    need = break_even_acceptance({2: 10}, 0.55, 1.47)  # 1 + α + α² = 2c + v: 0.85
    assert text.startswith("Why it is (not) faster: Acceptance: the early exit's α 0.76 at E = 4 is below "
                           f"the {need:.2f} it needs at c = 0.55, v = 1.47, k = 2")
    assert "Draft cost: a draft step costs c = 0.55 plain steps" in text  # beyond the weights' share
    assert "Overhead: the work between a round's passes costs 0.30 plain steps" in text
    assert "Verdict: ngram is fastest at 1.20× plain (early_exit 0.96×)" in text and "\n" not in text
    hopeless = {**losing, "cost_model": {**cost, "k_rounds": {1: 10}, "draft_cost": 0.9, "verify_cost": 1.2}}
    assert "no α pays for k = 2" in diagnosis(hopeless)
    assert diagnosis({"settings": {}, "methods": {"hf_greedy": {}}}) is None  # nothing to check
    # under a grammar forced tokens (α 1, no draft step) share the rounds: the exit is judged by its own α
    forced = {**losing, "sources": {"early_exit": {"forced": {"drafted": 30, "acceptance_rate": 1.0},
                                                   "early_exit": {"drafted": 20, "acceptance_rate": 0.34}}}}
    assert "the early exit's α 0.34 at E = 4" in diagnosis(forced)


def test_each_engine_method_may_decode_at_its_own_setting():
    model = tiny_model("llama")
    fastest = {"early_exit": DecodeSettings(exit_layer=2, num_speculations=2),
               "hybrid": DecodeSettings("hybrid", 1, 1, 40).override(min_ngram=1)}
    checkpoint = LoadedCheckpoint(model, DecodeSettings(exit_layer=3, num_speculations=3), fastest=fastest,
                                  token_counts=ranking_counts(range(40), 96))
    report = run_benchmark(checkpoint, [[5, 6, 7, 8, 5, 6, 7, 8]],
                           BenchmarkRun(max_new_tokens=8, repeats=1, warmup=0,
                                        methods=("plain", "early_exit", "ngram", "hybrid", "hf_early_exit")))
    settings = report["settings"]
    assert (settings["early_exit"]["exit_layer"], settings["early_exit"]["num_speculations"]) == (2, 2)
    assert settings["hybrid"]["draft_vocab_size"] == 40 and settings["hybrid"]["ngram"]["min_ngram"] == 1
    assert settings["ngram"]["exit_layer"] == 3  # the common setting
    assert report["greedy_outputs_identical"] and report["identical"]["hf_early_exit"]
    assert "| hf_early_exit | " in to_markdown(report) and "| early_exit |" in to_markdown(report)


def test_with_a_prefix_cache_each_timed_call_loads_the_prefix_its_prompt_shares_with_another():
    model = tiny_model("llama")
    shared = [(7 * i) % 90 + 1 for i in range(40)]  # a chunk of 32 and more
    prompts = [shared + [5, 6, 7, 8], shared + [9, 10], [3] + shared]
    report = run_benchmark(LoadedCheckpoint(model, DecodeSettings(exit_layer=3, num_speculations=3)), prompts,
                           BenchmarkRun(max_new_tokens=6, repeats=1, warmup=0,
                                        methods=("plain", "early_exit", "hybrid"), prefix_cache=True))
    assert report["greedy_outputs_identical"]
    cached = report["prefix_cache"]
    assert cached["chunk"] == 32 and cached["shared_tokens"] == (40 + 40 + 0) / 3
    assert cached["loaded_tokens_per_call"] == 32 * 2 / 3  # the first two prompts' first chunk, each call
    assert "Prefix cache: " in to_markdown(report)


def test_batched_benchmark_decodes_rows_together():
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]  # one length: Hugging Face needs no padding
    methods = ("plain", "early_exit", "hf_greedy")
    checkpoint = LoadedCheckpoint(model, DecodeSettings(exit_layer=3, num_speculations=3))
    options = BenchmarkRun(max_new_tokens=8, repeats=1, warmup=0, methods=methods, batch_size=2)
    batched = run_benchmark(checkpoint, prompts, options)
    # plain, the early exit and Hugging Face's batched greedy decoding give the same rows
    assert batched["batch_size"] == 2 and batched["greedy_outputs_identical"]
    assert sum(batched["cost_model"]["accepted_histogram"]) > 0 and "batch 2" in to_markdown(batched)
    with pytest.raises(ValueError, match="batch 1 only; leave hf_early_exit, hf_prompt_lookup, hf_draft out"):
        BenchmarkRun(batch_size=2, methods=METHODS)  # refused as the options are made


def test_eval_speedup_end_to_end(tiny_run, tmp_path):
    """`selfspec eval speedup`: the flags reach the benchmark, the report is written."""
    from selfspec.cli import main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):", [5, 6, 7]]))
    assert main(["eval", "speedup", "--model", str(tiny_run["model"]), "--exit-layer", "2",
                 "--num-speculations", "auto", "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--repeats", "1", "--warmup", "0", "--methods", "plain,early_exit,hf_greedy",
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert (report["greedy_outputs_identical"]
            and report["settings"]["early_exit"]["num_speculations"] == "auto")
    assert (tmp_path / "out" / "benchmark.md").is_file()


def test_eval_speedup_times_the_exported_draft_in_hugging_faces_assisted_generation(tiny_run, tmp_path):
    """`--methods hf_draft --draft DIR`: the exit exported as a draft model assists Hugging Face's
    generate, its tokens equal to Hugging Face's greedy and the engine's plain; without --draft, one line."""
    from selfspec.cli import main
    from selfspec.export import export_draft

    draft = export_draft(tiny_run["model"], tmp_path / "draft", exit_layer=2)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):", "import os\n"]))
    common = ["eval", "speedup", "--model", str(tiny_run["model"]), "--exit-layer", "2",
              "--prompts", str(prompts), "--max-new-tokens", "12", "--repeats", "1", "--warmup", "0"]
    assert main([*common, "--methods", "plain,hf_greedy,hf_draft", "--draft", str(draft),
                 "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert report["identical"]["hf_draft"] and report["identical"]["hf_greedy"]
    assert report["speedups"]["hf_draft_over_hf_greedy"] > 0 and report["draft"] == str(draft)
    assert "assistant_model = the exported draft" in (tmp_path / "out" / "benchmark.md").read_text()
    with pytest.raises(ValueError, match="--methods hf_draft needs --draft DIR"):
        BenchmarkRun(methods="plain,hf_draft")


def test_prompts_from_a_corpus_test_split(tiny_run, tmp_path):
    from selfspec.evaluation.prompts import prompts_from_corpus

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"def function_{i}(x):\n    return x * {i} + {i * 7}" for i in range(100)))
    prompts = prompts_from_corpus(tiny_run["tokenizer"], str(corpus), num_prompts=3, prompt_tokens=6)
    assert len(prompts) == 3 and all(len(p) == 6 for p in prompts)
