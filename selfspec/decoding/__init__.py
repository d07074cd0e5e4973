"""Self-speculative decoding: KV cache with rollback, sampling rules, the draft/verify loop, adaptive k,
drafts copied from the context (n-grams) and a trimmed draft head."""

from ..sampling import SamplingParams, accept_greedy, accept_sampled, residual_probs
from .cache import CacheLengthError, KVCache
from .controller import Controller, CostModelRule, FixedK, WindowRule, make_controller
from .costs import CostGate, RoundCosts
from .draft_head import DraftHead
from .engine import CallOptions, ContextSwitch, Engine
from .generation import GenerationConfig
from .grammar import Constraint
from .lanes import Lanes
from .ngram import NGramConfig
from .outputs import GenerationOutput, GenerationStats, NewRow, RoundCounts, RoundOutput
from .policy import DRAFTERS, DraftPlan, DraftPolicy, make_policy
from .settings import (
                       ADAPTIVE_K,
                       CONTEXT,
                       PLAIN,
                       SAMPLED,
                       DecodeSettings,
                       context_key,
                       context_picks,
                       parse_num_speculations,
                       sampled_key,
                       sampled_pick,
)
from .speculative import SelfSpecGenerator

__all__ = [
    "ADAPTIVE_K", "CONTEXT", "DRAFTERS", "PLAIN", "SAMPLED", "CallOptions", "ContextSwitch",
    "DecodeSettings", "Engine", "RoundOutput", "context_key", "context_picks", "parse_num_speculations",
    "sampled_key", "sampled_pick", "CacheLengthError", "Constraint", "Controller", "CostGate",
    "CostModelRule", "DraftHead", "DraftPlan", "DraftPolicy", "FixedK", "GenerationConfig",
    "GenerationOutput", "GenerationStats", "KVCache", "Lanes", "NGramConfig", "NewRow", "RoundCosts",
    "RoundCounts", "SamplingParams", "SelfSpecGenerator", "WindowRule", "accept_greedy", "accept_sampled",
    "make_controller", "make_policy", "residual_probs"]
