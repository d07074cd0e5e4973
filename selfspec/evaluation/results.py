"""The typed results of the evaluation commands: what each report holds at its top level.

The reports stay JSON-shaped (they are written as `<name>.json` and read back by the write-back and
the plots), so each is a `TypedDict`: a type checker and an editor know every key, and
`tests/test_results.py` holds each command's real report to its declaration. Nested parts whose
keys are data (a method, a category, an exit) are typed by their values.
"""

# No `from __future__ import annotations`: TypedDict reads NotRequired from evaluated annotations.
from typing import Any, TypedDict

try:  # Python 3.11+
    from typing import NotRequired
except ImportError:  # pragma: no cover - 3.10
    from typing_extensions import NotRequired


class PairedSpeedup(TypedDict):
    """A method's speedup over plain decoding, paired repeat by repeat (`paired.median_interval`)."""

    speedup: float
    low: float
    high: float
    coverage: float
    spread: list[float]


class MethodResult(TypedDict):
    tokens_per_second: float
    tokens_per_second_all: list[float]
    over_plain: NotRequired[PairedSpeedup]


class BenchmarkReport(TypedDict):
    """`benchmark.run_benchmark` / `selfspec eval speedup`."""

    max_new_tokens: int
    num_prompts: int
    batch_size: int
    repeats: int
    warmup: int
    device: str
    dtype: str
    num_layers: int
    settings: dict[str, dict]  # engine method -> `DecodeSettings.to_json()`
    draft: str | None  # hf_draft's exported draft (None when hf_draft did not run)
    methods: dict[str, MethodResult]
    speedups: dict[str, float]  # "a_over_b" -> ratio of medians
    sampling: str  # `SamplingParams.describe()`: greedy, or the settings every method sampled with
    reference: str  # the method every output is compared with (plain when measured)
    identical: NotRequired[dict[str, bool]]  # greedy only: sampled outputs are draws
    greedy_outputs_identical: NotRequired[bool]
    sources: dict[str, dict]  # engine method -> draft source -> rounds, drafted, accepted, α, share
    prefill: dict[str, dict]  # engine method -> the prefill's share, decoding tokens/s and × plain after it
    grammar: NotRequired[dict]  # the masks' cost, under a constraint
    cost_model: NotRequired[dict]  # α, mean k, c, v, predictions, break-even α (plain and early_exit)
    round_profile: NotRequired[dict]  # with profile=True
    # with candidates: drafter -> its sweep cells timed again and the stored one ÷ the best
    candidates: NotRequired[dict]
    # with a prefix cache: its chunk, the prompts' mean tokens, mean prefix shared with another, and
    # positions an engine call loaded from it
    prefix_cache: NotRequired[dict]
    diagnosis: str | None  # `diagnosis.summary`: the checklist in one paragraph
    model: NotRequired[str]  # the command's model argument


class SweepReport(TypedDict):
    """`sweep.run_sweep` / `selfspec eval sweep`."""

    num_layers: int
    max_new_tokens: int
    num_prompts: int
    measured_over_predicted: float
    table_stop_below: float
    sampling: str  # `SamplingParams.describe()`: greedy, or how every cell sampled
    repeats: int
    warmup: int
    device: str
    plain_tokens_per_second: float
    plain_step_seconds: float
    per_exit_layer: dict[str, dict[str, dict]]  # E -> V' -> α, c, draft step
    grid: list[dict]  # one row per setting
    confirm_repeats: int
    confirmed: list[dict]  # the re-timed cells, fastest first
    fastest_per_drafter: dict[str, dict]
    best: dict | None
    all_identical_to_plain: bool | None  # None for a sampled grid: its outputs are draws
    diagnosis: str | None
    model: NotRequired[str]
    prompts_from: NotRequired[str]
    # a greedy write-back's round costs by context length (`context_costs.measure_round_costs`' rows)
    round_costs: NotRequired[list[dict]]
    confirm_context: NotRequired[int]  # the long prompts' tokens where the re-timing ran after them too
    context: NotRequired[int]  # --context: the prompts' tokens where the whole grid ran
    from_tokens: NotRequired[int]  # --context: the context from which greedy decodes take its pick


class SuiteReport(TypedDict):
    """`suite.run_suite` / `selfspec eval suite`."""

    num_questions: int
    num_prompts: int
    cut_prompts: int
    max_new_tokens: int
    stop_at_eos: bool
    batch_size: int
    repeats: int
    warmup: int
    device: str
    dtype: str
    num_layers: int
    settings: dict[str, dict]
    questions_per_category: dict[str, int]
    sampling: str
    reference: str
    identical: NotRequired[dict[str, bool]]  # greedy only
    greedy_outputs_identical: NotRequired[bool]
    results: dict[str, dict[str, dict]]  # category (and "overall") -> method -> figures
    cost_model: NotRequired[dict]
    diagnosis: str | None
    seconds: float
    model: NotRequired[str]
    suites: NotRequired[str | None]
    questions: NotRequired[str | None]


class RooflineReport(TypedDict):
    """`roofline.roofline` / `selfspec eval roofline`."""

    num_layers: int
    exit_layer: int
    context: int
    repeats: int
    device: str
    dtype: str
    threads: int
    bandwidth: dict[str, float]
    passes: dict[str, dict[str, Any]]  # pass name -> seconds, bytes, limit, fraction, plain steps
    round_profile: NotRequired[dict]
    model: NotRequired[str]


class DoctorResult(TypedDict):
    """`doctor.doctor` / `selfspec doctor`."""

    figures: dict[str, Any]  # the probe's figures (`diagnosis.diagnose` names them)
    diagnosis: list[str]


class ServeLevel(TypedDict):
    concurrency: int
    requests: int
    seconds: float
    tokens_per_second: float
    errors: int
    mismatches: int
    first_token_p50: float
    first_token_p95: float
    inter_token_p50: float
    inter_token_p95: float


class ServeLoadReport(TypedDict):
    """`serve_load.serve_load` / `selfspec eval serve-load`."""

    model: str
    settings: str
    requests: int
    sampling: str  # `SamplingParams.describe()` of the load's requests (the fault run's are greedy)
    max_tokens: int
    num_prompts: int
    max_batch: int
    in_process_tokens_per_second: float
    in_process_plain_tokens_per_second: float
    in_process_speedup: dict  # paired (each prompt by both): speedup over plain decoding, low, high, ..
    served_speedup: dict  # the same for the two servers, one client streaming
    served_vs_in_process: dict  # streamed, paired: speedup (served ÷ in-process), low, high, coverage, spread
    whole_vs_in_process: dict  # the same for replies in one response (no stream)
    levels: dict[str, list[ServeLevel]]  # arm -> one row per concurrency
    fault: dict | None


def keys_of(report_type: type) -> tuple[set[str], set[str]]:
    """(required keys, optional keys) of one of these TypedDicts."""
    return set(report_type.__required_keys__), set(report_type.__optional_keys__)


__all__ = ["BenchmarkReport", "DoctorResult", "RooflineReport", "ServeLoadReport", "SuiteReport",
           "SweepReport", "keys_of"]
