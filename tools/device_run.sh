#!/usr/bin/env bash
# The GPU checks in one call of a lent GPU machine that has PyTorch but not selfspec's other
# dependencies and no network (this workplace's `device` tool: the repository is copied there, $OUT
# comes back). Prepare here, once, the wheels it lacks (Python 3.12 there):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 -d .whl \
#     transformers datasets dill multiprocess fastapi starlette pydantic pydantic-core annotated-types \
#     annotated-doc typing-inspection opentelemetry-api uvicorn httptools h11 anyio openai httpx2 httpcore2 \
#     jiter sniffio truststore llguidance gguf huggingface-hub hf-xet kernels tomlkit peft fsspec regex \
#     typing-extensions click idna        (pin each to the version installed here)
# and put the model to check in an ignored folder, e.g. .gpu/model. Then run, carrying .whl and .gpu:
#   MODEL=.gpu/model TRAIN_OVERRIDES="early_exit.layers=3,4,6 exit_layer=4" bash tools/device_run.sh
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail -n 5 "$OUT/pip.log"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
# `selfspec` and `python` as two-line scripts in a fresh folder: a link to a virtual environment's
# interpreter would start it outside its environment (and writing through an old link overwrites it)
bin=$(mktemp -d)
printf '#!/bin/sh\nexec python3 -m selfspec "$@"\n' > "$bin/selfspec"
printf '#!/bin/sh\nexec python3 "$@"\n' > "$bin/python"
chmod +x "$bin/selfspec" "$bin/python"
export PATH=$bin:$PATH
python3 -c "import torch, transformers, accelerate, peft, datasets; print('versions: torch', torch.__version__,
  'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)" || exit 4
echo "setup $((SECONDS - start)) s"
# the tests that run only with CUDA, their failures in full
timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider -rs tests/test_decoding_speculative.py -k cuda \
  2>&1 | tee "$OUT/pytest.txt" | tail -n 60
echo "tests done at $((SECONDS - start)) s"
bash tools/gpu_check.sh /tmp/gpu_check 2>&1 | tee "$OUT/check.txt"
echo "all done at $((SECONDS - start)) s"
for name in train speedup serve static; do cp "/tmp/gpu_check/$name.log" "$OUT/" 2>/dev/null; done
