#!/usr/bin/env bash
# The wheels the device check needs on a lent GPU machine that has PyTorch but not all of selfspec's
# dependencies and no network, built here into .whl/ in one command (Python 3.12 there):
#   bash tools/device_wheels.sh            # then carry .whl with the repository: bash tools/device_run.sh
# Each is pinned to the version installed here (the versions the tests ran with); DeepSpeed, for the
# optional zero2 stage, is built from its source without its compiled ops (JIT there; about 2 MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PACKAGES="transformers huggingface-hub kernels httpx2 httpcore2 truststore hf-xet tokenizers datasets dill
multiprocess tomlkit accelerate peft safetensors pydantic pydantic-core annotated-types typing-inspection"
# DeepSpeed's own dependencies, which selfspec's environment does not hold: their tested versions
DEEPSPEED_DEPENDENCIES="hjson==3.1.0 einops==0.8.2 msgpack==1.2.4 py-cpuinfo==9.0.0"
pinned=($DEEPSPEED_DEPENDENCIES)
for name in $PACKAGES; do
  version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
    || { echo "$name is not installed here: install selfspec's dependencies first" >&2; exit 2; }
  pinned+=("$name==$version")
done
mkdir -p .whl
echo '*' > .whl/.gitignore  # out of git: it travels as an ignored path (the device tool's `carry`)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pinned[@]}"
deepspeed=${DEEPSPEED_VERSION:-0.19.8}
if ! ls .whl/deepspeed-"$deepspeed"-*.whl >/dev/null 2>&1; then
  source_dir=$(mktemp -d)
  "$PYTHON" -m pip download -q --no-deps --no-binary=:all: "deepspeed==$deepspeed" -d "$source_dir"
  DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation \
    "$source_dir/deepspeed-$deepspeed.tar.gz" -w .whl
  rm -rf "$source_dir"
fi
du -sh .whl
