#!/usr/bin/env bash
# The device check (tools/device_check.py) in one call of a lent GPU machine that has PyTorch but not
# all of selfspec's dependencies and no network (this workplace's `device` tool: the repository is copied
# there, $OUT comes back). Prepare here, once, the wheels it lacks (Python 3.12 there), pinned to the
# versions installed here:
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers huggingface-hub kernels httpx2 httpcore2 truststore hf-xet tokenizers datasets dill \
#     multiprocess tomlkit hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
#     typing-inspection==0.4.2
# and DeepSpeed for the zero2 stage, built here without its compiled ops (JIT there; 2 MiB):
#   pip download --no-deps --no-binary=:all: deepspeed==0.19.8 -d /tmp/ds &&
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation /tmp/ds/deepspeed-0.19.8.tar.gz -w .whl
# Then run it carrying .whl (about 30 MiB):  bash tools/device_run.sh [STAGES]   (default: every stage)
set -o pipefail
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail -n 5 "$OUT/pip.log"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
python3 tools/device_check.py --out "$OUT" ${1:+--only "$1"}
status=$?
cat "$OUT/verdicts.txt"
exit $status
