"""The modules one round's call path crosses: every selfspec function a round calls, by module, in order.

    python tools/round_path.py [--tree DIR] [--backend reference|cpu_kernels|static] [--drafter early_exit]
                               [--sampled] [--level decode|rounds|passes]

Builds a tiny Llama in-process, decodes one prompt, and records (`sys.setprofile`) the calls made during its
third `Engine.step` (a round in the steady state: the first starts the batch, the second may differ from
the rest); prints the modules in the order first entered, with each module's count of calls. `--tree`
imports selfspec from another checkout (old against new: `git worktree add /tmp/old HEAD~1`). `--level`
keeps the compiled calls up to that level (`fast.kernels_up_to`; "decode": all, fused rounds included).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", default=None, help="a checkout whose selfspec to import")
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--drafter", default="early_exit")
    parser.add_argument("--sampled", action="store_true")
    parser.add_argument("--level", default="passes", choices=("decode", "rounds", "passes"))
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfspec.decoding import NewRow, SelfSpecGenerator
    from selfspec.model import fast
    from selfspec.sampling import SamplingParams

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    gen = SelfSpecGenerator(model, exit_layer=2, num_speculations=3, drafter=args.drafter,
                            backend=args.backend, static_passes="eager" if args.backend == "static" else None)
    params = SamplingParams(temperature=0.8, top_p=0.95) if args.sampled else SamplingParams()
    row = NewRow([5, 17, 17, 9, 5, 17, 17, 9, 5, 17], max_new_tokens=32, sampling=params, seed=3)
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("selfspec"):
                calls.append(module)

    with fast.kernels_up_to(args.level), torch.no_grad():
        engine = gen.engine(eos_token_id=[])
        engine.add(row)
        engine.step()
        engine.step()
        sys.setprofile(profile)
        engine.step()
        sys.setprofile(None)
    counts = Counter(calls)
    order = list(dict.fromkeys(calls))
    print(f"{len(order)} modules, {len(calls)} calls: " + ", ".join(f"{m} ({counts[m]})" for m in order))


if __name__ == "__main__":
    main()
