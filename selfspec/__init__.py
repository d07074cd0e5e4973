"""selfspec: self-speculative decoding — a model's own first layers draft, the rest verify, losslessly.

    from selfspec import load_tuned
    gen = load_tuned("runs/demo/model")          # a tuned checkpoint, or any Hugging Face causal LM
    out = gen.generate(["def fibonacci(n):"], max_new_tokens=64)
    reply = gen.chat([{"role": "user", "content": "Hi!"}]).texts[0]   # instruct models
"""

from .checkpoint import Provenance, load_tuned, save_tuned
from .decoding import DecodeSettings, GenerationConfig, GenerationOutput, SelfSpecGenerator

__version__ = "0.1.0"

__all__ = ["DecodeSettings", "GenerationConfig", "GenerationOutput", "Provenance", "SelfSpecGenerator",
           "load_tuned", "save_tuned",
           "__version__"]
