"""selfspec: self-speculative decoding — a model's own first layers draft, the rest verify, losslessly.

    from selfspec import load_tuned
    gen = load_tuned("runs/demo/model")
    out = gen.generate(["def fibonacci(n):"], max_new_tokens=64)
"""

from .checkpoint import load_tuned, save_tuned
from .model import DecoderView

__version__ = "0.1.0"


def __getattr__(name):
    # The decoding engine imports lazily so that `import selfspec` stays light for training-only use.
    if name == "SelfSpecGenerator":
        from .decoding import SelfSpecGenerator

        return SelfSpecGenerator
    raise AttributeError(f"module 'selfspec' has no attribute {name!r}")


__all__ = ["DecoderView", "SelfSpecGenerator", "load_tuned", "save_tuned", "__version__"]
