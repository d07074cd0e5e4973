"""Model access: `DecoderView` over Hugging Face causal LMs, and building/loading models."""

from .adapters import SUPPORTED_MODEL_TYPES, UnsupportedArchitectureError, adapter_for
from .view import DecoderView, LayerContext, num_layers, unwrap_model

__all__ = ["DecoderView", "LayerContext", "SUPPORTED_MODEL_TYPES", "UnsupportedArchitectureError",
           "adapter_for", "num_layers", "unwrap_model"]
