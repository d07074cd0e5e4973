#!/usr/bin/env bash
# The device check (tools/device_check.py) in one call of a lent GPU machine that has PyTorch but not
# all of selfspec's dependencies and no network (this workplace's `device` tool: the repository is copied
# there, $OUT comes back). Build the wheels it lacks here first, once: `bash tools/device_wheels.sh`
# (into .whl/, about 30 MiB), then run this there carrying .whl:
#   bash tools/device_run.sh [STAGES]      (default: every stage; e.g. lossless,smoke)
# Its exit status is the check's: 0 only when every stage of the mission ran and no verdict failed.
set -o pipefail
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { tail -n 5 "$OUT/pip.log"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
python3 tools/device_check.py --out "$OUT" ${1:+--only "$1"}
rc=$?
# what comes back: verdicts.txt and one archive of the logs and figures (a device call returns at most 8
# files; the runs' checkpoints stay behind)
(cd "$OUT" && find . \( -name '*.log' -o -name '*.json' \) ! -name verdicts.txt | tar -czf logs.tar.gz -T - \
  && find . -mindepth 1 -maxdepth 1 ! -name verdicts.txt ! -name logs.tar.gz -exec rm -rf {} +)
exit $rc
