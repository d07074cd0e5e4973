"""Self-speculative decoding: KV cache with rollback, sampling rules, the draft/verify loop, adaptive k."""

from .cache import CacheLengthError, KVCache
from .controller import Controller, CostModelRule, FixedK, WindowRule, make_controller
from .sampling import SamplingParams, accept_greedy, accept_sampled, residual_probs
from .speculative import GenerationOutput, GenerationStats, SelfSpecGenerator

__all__ = ["CacheLengthError", "Controller", "CostModelRule", "FixedK", "GenerationOutput", "GenerationStats",
           "KVCache", "SamplingParams", "SelfSpecGenerator", "WindowRule", "accept_greedy", "accept_sampled",
           "make_controller", "residual_probs"]
