"""selfspec: self-speculative decoding — a model's own first layers draft, the rest verify, losslessly.

    from selfspec import load_tuned
    gen = load_tuned("runs/demo/model")          # a tuned checkpoint, or any Hugging Face causal LM
    out = gen.generate(["def fibonacci(n):"], max_new_tokens=64)
    reply = gen.chat([{"role": "user", "content": "Hi!"}]).texts[0]   # instruct models
"""

from .checkpoint import load_tuned, save_tuned
from .decoding import DecodeSettings, GenerationOutput, SelfSpecGenerator

__version__ = "0.1.0"

__all__ = ["DecodeSettings", "GenerationOutput", "SelfSpecGenerator", "load_tuned", "save_tuned",
           "__version__"]
