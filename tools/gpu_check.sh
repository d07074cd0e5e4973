#!/usr/bin/env bash
# The GPU recipes checked on one lent GPU in under 10 minutes, one line per check:
#   1. 50 steps of a GPU recipe (gpu_common.yaml: bf16, layer dropout p_max 0.2, KL exits);
#   2. the gate (perplexity of the tuned model vs its base);
#   3. greedy equality of every drafter with plain decoding in bf16 (`eval speedup`'s `identical`);
#   4. the speedup table against Hugging Face greedy and assistant_early_exit;
#   5. the server on the GPU in fp32 (`eval serve-load`): one and eight clients, every reply equal to its
#      prompt decoded alone in process, throughput, and the speedup over the server without drafting;
#   6. the same as 4 on static passes compiled with CUDA graphs (`--static-passes compile`): equality and speed.
#     bash tools/gpu_check.sh [OUT]          (default OUT: runs/gpu_check)
# The machine may have no network: MODEL is a local directory or a name already in the Hugging Face
# cache (default Qwen/Qwen2.5-0.5B, the qwen2.5-0.5b_lora recipe's), DATA a local corpus or stdlib.
# TRAIN_OVERRIDES adds `key=value` overrides to the training run, e.g. candidate exits that a smaller
# model has: TRAIN_OVERRIDES="early_exit.layers=3,4,6 exit_layer=4" for the embedded default's 12 layers.
set -euo pipefail
OUT=${1:-runs/gpu_check}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B}
DATA=${DATA:-stdlib}
RECIPE=${RECIPE:-qwen2.5-0.5b_lora}
read -r -a TRAIN_OVERRIDES <<< "${TRAIN_OVERRIDES:-}"
mkdir -p "$OUT"

line() { printf '%-10s %s\n' "$1" "$2"; }
fail() { line "$1" "FAIL: $2"; exit 1; }

# Fail fast: everything below needs CUDA (bf16 units, the GPU recipe's batch).
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail device "no CUDA device (torch.cuda.is_available() is False); this script checks the GPU recipes"
line device "$(python -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}")')"

start=$SECONDS
selfspec train --config "$RECIPE" --output-dir "$OUT/train" --force \
  model.name_or_path="$MODEL" data.source="$DATA" data.block_size=512 optim.max_steps=50 \
  optim.warmup_steps=5 optim.grad_accum=1 eval_every=0 save_every=0 log_with=[jsonl] \
  "${TRAIN_OVERRIDES[@]}" > "$OUT/train.log" 2>&1 || fail train "see $OUT/train.log"
line train "$(python - "$OUT" "$((SECONDS - start))" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/train/metrics.jsonl")]
steps = [r for r in rows if "loss" in r]
print(f"50 steps bf16 with layer dropout in {sys.argv[2]} s: loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
PY
)"

if selfspec eval gate --tuned "$OUT/train/model" --base "$MODEL" --data "$DATA" --max-blocks 16 \
     --json "$OUT/gate.json" > "$OUT/gate.log" 2>&1; then gate=passed; else gate=failed; fi
line gate "$gate: $(tail -n 1 "$OUT/gate.log")"

selfspec eval speedup --model "$OUT/train/model" --corpus "$DATA" --dtype bfloat16 --num-prompts 4 \
  --max-new-tokens 128 --repeats 3 --methods plain,early_exit,ngram,hybrid,hf_greedy,hf_early_exit \
  --out "$OUT/speedup" > "$OUT/speedup.log" 2>&1 || fail speedup "see $OUT/speedup.log"
python - "$OUT/speedup" <<'PY'
import json, sys
from pathlib import Path
report = json.loads(next(Path(sys.argv[1]).glob("*.json")).read_text())
drafters = {m: ok for m, ok in report["identical"].items() if m in ("early_exit", "ngram", "hybrid", "hf_greedy")}
print(f"{'identical':<10} {'yes' if all(drafters.values()) else 'NO'}: " + ", ".join(f"{m} {ok}" for m, ok in drafters.items()))
PY
line speedup "table in $OUT/speedup (Markdown beside the JSON):"
cat "$(ls "$OUT"/speedup/*.md | head -n 1)" | sed -n '/^|/p'

# 5. the server: its batches on the GPU must decode each row as that prompt alone (fp32, greedy)
selfspec eval serve-load --model "$OUT/train/model" --dtype float32 --concurrency 1,8 --requests 16 \
  --max-tokens 64 --out "$OUT/serve" > "$OUT/serve.log" 2>&1 || fail serve "see $OUT/serve.log"
python - "$OUT/serve" <<'PY'
import json, sys
from pathlib import Path
report = json.loads(next(Path(sys.argv[1]).glob("*.json")).read_text())
rows = [row for arm in report["levels"].values() for row in arm]
bad = sum(r["mismatches"] + r["errors"] for r in rows)
print(f"{'serve':<10} every reply as alone: {'yes' if bad == 0 else f'NO ({bad} mismatches or errors)'}")
PY
sed -n '/^|/p;/^One client/,$p' "$(ls "$OUT"/serve/*.md | head -n 1)"

# 6. every decoding pass at fixed shapes through torch.compile (CUDA graphs): the round at its passes' cost
timeout 200 selfspec eval speedup --model "$OUT/train/model" --corpus "$DATA" --dtype bfloat16 --num-prompts 4 \
  --max-new-tokens 128 --repeats 3 --methods plain,early_exit,hybrid,hf_greedy --static-passes compile \
  --out "$OUT/static" > "$OUT/static.log" 2>&1 || fail static "see $OUT/static.log"
python - "$OUT/static" <<'PY'
import json, sys
from pathlib import Path
report = json.loads(next(Path(sys.argv[1]).glob("*.json")).read_text())
same = {m: ok for m, ok in report["identical"].items() if m in ("early_exit", "hybrid")}
print(f"{'static':<10} identical {'yes' if all(same.values()) else 'NO'}: " + ", ".join(f"{m} {ok}" for m, ok in same.items()))
PY
cat "$(ls "$OUT"/static/*.md | head -n 1)" | sed -n '/^|/p'
line total "$((SECONDS - start)) s"
