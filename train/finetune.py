"""Self-speculative fine-tune from a checkout: the same as `selfspec train` (`selfspec train --help`).

    accelerate launch train/finetune.py --config demo_finetune optim.max_steps=100
    accelerate launch --config_file "$(selfspec recipes --path accelerate/ddp)" train/finetune.py \
        --config qwen2.5-0.5b_lora

Kept as the design's `accelerate launch train/...` entry; from any directory use `selfspec train`,
or `accelerate launch -m selfspec train ...` for many processes.
"""

import sys

from selfspec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
