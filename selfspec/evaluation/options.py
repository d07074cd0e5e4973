"""The evaluation commands' options, each flag declared once (`selfspec.flags`): the groups they share
(which prompts, how long and how often they are timed, which methods, where the model runs, which
suite questions) and each command's own options, built from them.

The groups that a command's inner function takes are its typed boundary: `benchmark.run_benchmark`
takes a `BenchmarkRun`, `sweep.run_sweep` a `SweepGrid`, `suite.run_suite` a `SuiteRun`; the command's
options are one of those too, so `speedup(options)` hands its own options on.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decoding import ADAPTIVE_K, DRAFTERS  # noqa: F401 - DRAFTERS: named in a docstring
from ..decoding.prefix import prefix_cache_of
from ..errors import UserError
from ..flags import (
    ConstraintOptions,
    CopyOverride,
    DecodeOverrides,
    DrafterOverride,
    Options,
    SamplingOptions,
    StaticPassesOption,
    option,
)
from .prompts import JSON_EXTRACT, SUITES  # noqa: F401 - SUITES: named in docstrings
from .timing import DEFAULT_METHODS, METHODS, check_methods  # noqa: F401 - METHODS: named in a docstring


def k_list(value: str) -> list:
    """--ks: a comma list of ints and the adaptive controllers' names, e.g. '1,2,4,auto'."""
    try:
        return sorted({v.strip() if v.strip() in ADAPTIVE_K else int(v) for v in value.split(",")},
                      key=k_order)
    except ValueError:
        raise UserError(f"--ks must be a comma list of ints or {'/'.join(ADAPTIVE_K)} such as '1,2,4,auto', "
                        f"got {value!r}") from None


def k_order(k):
    """The order of draft lengths: the ints, then the adaptive controllers' names."""
    return (0, k, "") if isinstance(k, int) else (1, 0, k)


def float_list(value: str) -> list[float]:
    """A comma list of numbers such as '0,0.4,0.6' (--stop-belows), in the order given."""
    try:
        return list(dict.fromkeys(float(v) for v in value.split(",")))
    except ValueError:
        raise UserError(f"expected a comma list of numbers such as '0,0.6', got {value!r}") from None


def int_list(value: str) -> list[int]:
    """A comma list of ints such as '1,2,4,8' (--min-ngrams, --draft-vocab-sizes)."""
    try:
        return sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise UserError(f"expected a comma list of ints such as '1,2,4,8', got {value!r}") from None


def name_list(value) -> tuple[str, ...]:
    """A comma list of names ('plain,early_exit'), or names already listed, each once, in order."""
    names = value.split(",") if isinstance(value, str) else value
    return tuple(dict.fromkeys(name.strip() for name in names if name.strip()))


# --------------------------------------------------------------------------------------------------
# The groups
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ModelOption(Options):
    """The model an evaluation measures, named by a flag."""

    model: str = option(flag="--model")
    """directory loadable with AutoModelForCausalLM"""


@dataclass(frozen=True, kw_only=True)
class PromptOptions(Options):
    """Which prompts (`prompts.read_prompts`)."""

    prompts: str | None = None
    """JSON list (token lists or strings) or text file; json-extract: extraction prompts, each under its
    schema (default: the corpus's test split)"""
    corpus: str = "stdlib"
    """without --prompts: prompts from this corpus's test split"""
    num_prompts: int = 8
    """use the first N prompts"""


@dataclass(frozen=True, kw_only=True)
class CorpusPromptOptions(PromptOptions):
    """Which prompts, and how long those taken from the corpus are."""

    prompt_tokens: int = 64
    """prompt length taken from corpus documents"""


@dataclass(frozen=True, kw_only=True)
class TimingOptions(Options):
    """How many tokens, how many interleaved repeats."""

    max_new_tokens: int = 128
    """new tokens per prompt"""
    repeats: int = 5
    """timed rounds (median)"""
    warmup: int = 1
    """untimed rounds first"""


@dataclass(frozen=True, kw_only=True)
class MethodOptions(Options):
    """Which decoding methods (`timing.METHODS`), and how many prompts each call decodes."""

    methods: str | tuple[str, ...] = DEFAULT_METHODS
    """comma-separated subset of {METHODS} (default: all but hf_draft)"""
    batch_size: int = 1
    """prompts per generate call (Hugging Face's assisted methods, hf_early_exit, hf_prompt_lookup and
    hf_draft, decode batch 1 only)"""
    draft: str | None = None
    """an exported draft's directory (`selfspec export MODEL --draft DIR`), for the hf_draft method:
    Hugging Face's generate(assistant_model=draft)"""

    def check(self):
        self._normalize(methods=name_list(self.methods))
        check_methods(self.methods, self.batch_size, self.draft)


@dataclass(frozen=True, kw_only=True)
class DeviceOptions(Options):
    """Where and in which dtype the model runs, and the report's directory."""

    device: str | None = None
    """cuda, cpu, ... (default: CUDA when there is one)"""
    dtype: str = "auto"
    """auto, float32, bfloat16 or float16"""
    out: str | None = None
    """the report's directory"""


@dataclass(frozen=True, kw_only=True)
class QuestionSource(Options):
    """Questions of named suites and/or a question file (`prompts.select_questions`)."""

    suites: str | None = option(None, flag="--suite")
    """comma list of {SUITES}"""
    questions: str | None = None
    """a .jsonl of question_id, category, turns (user messages, chat template)"""


@dataclass(frozen=True, kw_only=True)
class QuestionOptions(QuestionSource):
    """Which questions, the first N of each category."""

    max_per_category: int | None = None
    """the first N questions of each category (default: all)"""


@dataclass(frozen=True, kw_only=True)
class ExitOptions(Options):
    """E and k of a probe (default: the checkpoint's)."""

    exit_layer: int | None = None
    """E (default: the checkpoint's)"""
    num_speculations: int | None = None
    """k of the profiled early exit (default: the checkpoint's)"""


@dataclass(frozen=True, kw_only=True)
class BenchmarkRun(TimingOptions, MethodOptions, StaticPassesOption, SamplingOptions):
    """How `benchmark.run_benchmark` times the methods."""

    keep_eos: bool = False
    """stop at eos (default: always max-new-tokens)"""
    profile: bool = False
    """add the round profile: where each engine method's rounds spend their time"""
    prefix_cache: bool = False
    """the engine prefills through a prefix cache that holds each prompt's prefix shared with the other
    prompts (a chat template's system turn), as a server's would"""


@dataclass(frozen=True, kw_only=True)
class SuiteRun(TimingOptions, MethodOptions, SamplingOptions):
    """How `suite.run_suite` times the methods over the questions."""

    repeats: int = 1
    """timed rounds over all prompts (median)"""
    warmup: int = 1
    """untimed decodes of the first prompt per method"""
    batch_size: int = 1
    """prompts of one category per generate call (Hugging Face's assisted methods: 1)"""
    no_eos: bool = False
    """always max-new-tokens (default: stop at eos)"""


@dataclass(frozen=True, kw_only=True)
class SweepGrid(TimingOptions, SamplingOptions):
    """The grid `sweep.run_sweep` measures and how it re-times its best cells. The lists take comma
    lists as the flags do."""

    max_new_tokens: int = 64
    repeats: int = 3
    ks: str | tuple = "1,2,3,4,6,8"
    """early-exit draft lengths k, e.g. '1,2,4,8,auto' (auto: the cost model per round)"""
    drafters: str | tuple[str, ...] = "early_exit"
    """comma list of {DRAFTERS} (default: early_exit)"""
    min_ngrams: str | tuple[int, ...] = "2"
    """copy thresholds of ngram/hybrid: the shortest context match that copies, e.g. '1,2,3'"""
    draft_vocab_sizes: str | tuple[int, ...] = "0"
    """V' of the draft head, e.g. '0,2048,8192' (0: the whole head; others need the checkpoint's token
    counts, see `selfspec draft-vocab`)"""
    stop_belows: str | tuple[float, ...] = "0"
    """η values of the early exit's stopping rule, e.g. '0,0.4,0.6' (0: never stop drafting)"""
    confirm: int = 3
    """re-time each drafter's N fastest cells against plain (0: no)"""
    confirm_repeats: int = 5
    """interleaved repeats of the re-timing; a cell is stored only when the interval of its paired
    speedups is above 1"""

    def check(self):
        def listed(value, parse, kind):
            return tuple(parse(value)) if isinstance(value, str) else tuple(kind(v) for v in value)

        self._normalize(ks=listed(self.ks, k_list, lambda k: k), drafters=name_list(self.drafters),
                        min_ngrams=listed(self.min_ngrams, int_list, int),
                        draft_vocab_sizes=listed(self.draft_vocab_sizes, int_list, int),
                        stop_belows=listed(self.stop_belows, float_list, float))


def _counts_at_least_one(options) -> None:
    """The benchmark's and the sweep's check of their counts (one message names all three)."""
    if options.num_prompts < 1 or options.repeats < 1 or options.max_new_tokens < 1:
        raise UserError(f"--num-prompts ({options.num_prompts}), --repeats ({options.repeats}) and "
                        f"--max-new-tokens ({options.max_new_tokens}) must be >= 1")


# --------------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class BenchmarkOptions(ModelOption, CorpusPromptOptions, BenchmarkRun, DecodeOverrides, CopyOverride,
                       ConstraintOptions, DeviceOptions):
    """`selfspec eval speedup` (`benchmark.speedup`)."""

    out: str = "runs/benchmark"
    candidates: bool = False
    """also time every cell the last sweep re-timed: is each drafter's stored cell still its fastest?"""

    def check(self):
        _counts_at_least_one(self)


@dataclass(frozen=True, kw_only=True)
class SweepOptions(ModelOption, CorpusPromptOptions, SweepGrid, QuestionOptions, DeviceOptions):
    """`selfspec eval sweep` (`sweep.sweep`)."""

    num_prompts: int = 4
    out: str = "runs/sweep"
    exit_layers: str | tuple[int, ...] | None = None
    """E values: a list '2,4,6', a slice '2:10:2' or 'all' (default: all, 1..N-1)"""
    write_back: bool = False
    """record the fastest setting in the checkpoint's selfspec.json"""
    cost_lengths: str = "auto"
    """context lengths at which a greedy --write-back measures a round's costs, which decoding then reads
    to draft only where drafting pays ('auto': 64, 256, 1024 and the model's longest, at most 4096;
    'none': not measured; or a comma list)"""
    suites: str | None = option(None, flag="--suite")
    """comma list of {SUITES} (the sweep times their first turns instead of --prompts/--corpus)"""
    max_per_category: int | None = 1
    """the first N questions of each category (default: 1)"""
    confirm_context: int = 0
    """re-time the --confirm cells after prompts of this many tokens from --corpus too (0: no); a cell's
    speedup is then the geometric mean of its short and long ones, so that the pick holds up at long
    contexts"""

    context: int = 0
    """time the grid after prompts of this many tokens from --corpus instead (0: short prompts): a pick
    for long contexts, which --write-back stores for greedy decodes from the geometric mean of this and the
    short prompts' length on"""

    def check(self):
        _counts_at_least_one(self)
        if self.context < 0:
            raise UserError(f"--context must be >= 0 (0: short prompts), got {self.context}")
        if self.context and (self.confirm_context or self.prompts or self.suites or self.questions):
            raise UserError("--context times the grid after long prompts from --corpus: leave out "
                            "--confirm-context, --prompts, --suite and --question")
        if self.context and self.context <= self.prompt_tokens:
            raise UserError(f"--context {self.context} must exceed --prompt-tokens {self.prompt_tokens} (the "
                            f"short prompts the checkpoint's own pick was timed on)")
        if self.context and not self.sampling().greedy:
            raise UserError("--context picks settings for greedy decodes: leave out --temperature")
        if self.confirm_context < 0:
            raise UserError(f"--confirm-context must be >= 0 (0: short prompts only), "
                            f"got {self.confirm_context}")
        if self.confirm_context and not self.confirm:
            raise UserError("--confirm-context re-times the --confirm cells: pass --confirm 1 or more")
        if self.confirm_context and self.prompts == JSON_EXTRACT:
            raise UserError("--confirm-context times free text after long prompts, not the extraction "
                            "prompts' schemas: leave it out with --prompts json-extract")


@dataclass(frozen=True, kw_only=True)
class SuiteOptions(ModelOption, QuestionOptions, SuiteRun, DecodeOverrides, CopyOverride, ConstraintOptions,
                   DeviceOptions):
    """`selfspec eval suite` (`suite.suite`)."""

    categories: str | None = None
    """comma list of the categories to run (default: all)"""
    out: str = "runs/suite"


@dataclass(frozen=True, kw_only=True)
class RooflineOptions(ModelOption, ExitOptions, PromptOptions, TimingOptions, DeviceOptions):
    """`selfspec eval roofline` (`roofline.run`)."""

    prompts: str | None = None
    """the profile's prompts: a file, or json-extract (default: the corpus's test split)"""
    corpus: str = "stdlib"
    """where the profile's prompts come from without --prompts"""
    context: int = 256
    """positions already in the KV cache"""
    max_positions: int = 8
    """verify and whole-model passes of 1..this"""
    repeats: int = 15
    warmup: int = 3
    num_prompts: int = 4
    """prompts the round profile decodes"""
    max_new_tokens: int = 64
    """tokens per prompt in the round profile"""
    profile_repeats: int = 3
    """timed repeats of the round profile (0: passes only)"""
    out: str = "runs/roofline"

    def check(self):
        if self.max_positions < 1 or self.profile_repeats < 0 or self.max_new_tokens < 1:
            raise UserError(f"--max-positions ({self.max_positions}) and --max-new-tokens "
                            f"({self.max_new_tokens}) must be >= 1, --profile-repeats "
                            f"({self.profile_repeats}) >= 0")
        if self.num_speculations is not None and self.num_speculations < 1:
            raise UserError(f"--num-speculations must be >= 1 (plain decoding is profiled anyway), "
                            f"got {self.num_speculations}")


@dataclass(frozen=True, kw_only=True)
class DoctorOptions(ExitOptions, PromptOptions, QuestionSource, DeviceOptions, SamplingOptions):
    """`selfspec doctor` (`doctor.doctor`)."""

    model: str = option(positional=True)
    """a checkpoint or model directory"""
    num_speculations: int | None = None
    """k (default: the checkpoint's, or 3)"""
    suites: str | None = option(None, flag="--suite")
    """first turns of a suite's questions, e.g. mt-bench (chat: the chat template)"""
    num_prompts: int = 2
    max_new_tokens: int = 32
    """new tokens per prompt"""
    context: int = 256
    """the short context the passes are timed at"""
    long_context: int = 2048
    """the long one"""
    repeats: int = 1
    """timed decodes of each prompt per method"""

    def check(self):
        if (self.num_prompts < 1 or self.max_new_tokens < 1 or self.repeats < 1
                or not 1 <= self.context < self.long_context):
            raise UserError(f"--num-prompts ({self.num_prompts}), --max-new-tokens ({self.max_new_tokens}) "
                            f"and --repeats ({self.repeats}) must be >= 1, and 1 <= --context "
                            f"({self.context}) < --long-context ({self.long_context})")


@dataclass(frozen=True, kw_only=True)
class ServeLoadOptions(ModelOption, PromptOptions, DecodeOverrides, DrafterOverride, DeviceOptions,
                       SamplingOptions):
    """`selfspec eval serve-load` (`serve_load.serve_load`)."""

    model: str = option(flag="--model")
    """a checkpoint or model directory"""
    concurrency: str | tuple[int, ...] = "1,2,4,8"
    """comma list of concurrent clients"""
    requests: int = 16
    """requests per level and arm"""
    max_tokens: int = 64
    """tokens per request"""
    max_batch: int = 8
    """the servers' --max-batch"""
    fault: int = 0
    """then this many requests, a third of them bad, and each fault class beside good requests"""
    fault_classes: str | tuple[str, ...] | None = "all"
    """comma list of the fault classes --fault sends (default: all; '': none): numeric overflow, hang-ups,
    abandoned flood, oversized and chunked bodies, slowloris, wrong content types, invalid utf-8, deep
    json, pathological schemas, huge stop strings, bad role orders"""
    prefix_cache_mb: int = 256
    """the servers' and the in-process generators' prefix caches (0: none)"""
    out: str = "runs/serve-load"

    def request_fields(self, prompt: int) -> dict:
        """The sampling fields of the request for prompt number `prompt` (OpenAI's names; a sampled
        request carries the seed + prompt, so that each prompt's reply is one seeded draw)."""
        if self.sampling().greedy:
            return {"temperature": 0}
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": (self.seed or 0) + prompt}

    def check(self):
        if isinstance(self.concurrency, str):  # the levels in the order given, as the report lists them
            try:
                self._normalize(concurrency=tuple(int(c) for c in self.concurrency.split(",")))
            except ValueError:
                raise UserError(f"--concurrency must be a comma list of ints such as '1,2,4', "
                                f"got {self.concurrency!r}") from None
        levels = tuple(self.concurrency)
        prefix_cache_of(self.prefix_cache_mb)  # a bad size fails before anything loads
        if self.requests < 1 or self.max_tokens < 1 or not levels or min(levels) < 1:
            raise UserError(f"--requests ({self.requests}), --max-tokens ({self.max_tokens}) and every "
                            f"--concurrency ({','.join(map(str, levels))}) must be >= 1")


__all__ = ["BenchmarkOptions", "BenchmarkRun", "CorpusPromptOptions", "DeviceOptions", "DoctorOptions",
           "ExitOptions", "MethodOptions", "ModelOption", "PromptOptions", "QuestionOptions",
           "QuestionSource", "RooflineOptions", "ServeLoadOptions", "SuiteOptions", "SuiteRun", "SweepGrid",
           "SweepOptions", "TimingOptions", "float_list", "int_list", "k_list", "k_order", "name_list"]
