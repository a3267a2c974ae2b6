#!/usr/bin/env bash
# Issue 15's and issue 19's GPU checks in one call of the device tool (one lent H100/H200, 15 device minutes a
# session): the machine's start costs one to two of them, so both scripts share one call of at most 600 s.
#
# Here, once (the wheels the machine lacks: torchao for QLoRA and 8-bit state, torchtitan 0.2.2 and its needs):
#
#   mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0 torchtitan==0.2.2 torchdata==0.11.0 \
#       datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
#
# then one device run: command `bash benchmarks/gpu_session.sh`, carry [".whl"], timeout_s 600. Then give_back.
#
# Run so far: 2026-12-04 on an H200 (docs/gpu-2026-12-04, docs/finetuning.md, docs/foundation.md): issue 15's 8B
# cases, the 1B eager comparison with torchtitan, shardwise's compiled 1B at the planner's 1 x 8. Still to run, and
# so the default now: the compiled comparison at the same batch (issue 19; that day's call skipped shardwise's run
# on a too-cautious estimate, since lowered), then the micro-batch study (benchmarks/gpu_checks.py's "mb" cases:
# LoRA at 1 x 8 and the 1B model at 1 x 8 and 8 x 1, eager and compiled, each with its last step profiled, host
# and device time per operator: why the planner's 1 x 8 ran at 0.54-0.65 of its tokens/s). PEER_CASES and CHECKS
# choose others, e.g. PEER_CASES="eager" CHECKS="8B" for the first session's order. Each script rewrites its table after every case or
# run, so what finished comes back even if the rest runs out of time. At most 8 files come back from $OUT: the two
# tables, the two JSON files, the checks' log, the comparison's logs and the profiles in an archive each.
#
set -u
TOTAL_S=${TOTAL_S:-570}
PEER_S=${PEER_S:-300}
PEER_CASES=${PEER_CASES:-compile eager}
CHECKS=${CHECKS:-mb }
OUT=${OUT:-/tmp/gpu_session}
PYTHON=${PYTHON:-python3}
WHL=${WHL:-.whl}
if [ "${SMOKE:-0}" = 1 ]; then checks=(--smoke); peer=(--smoke); else checks=(); peer=(); fi
mkdir -p "$OUT"
rm -rf /tmp/site /tmp/ptg /tmp/gpu_checks
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
# shellcheck disable=SC2086  # PEER_CASES is a list of words
timeout $((PEER_S + 10)) "$PYTHON" benchmarks/peer_torchtitan_gpu.py "${peer[@]}" --cases $PEER_CASES --reps 1 \
    --budget-s $((PEER_S - 15)) --out /tmp/ptg
cp /tmp/ptg/peer_torchtitan_gpu.md /tmp/ptg/peer_torchtitan_gpu.json "$OUT"/ 2>/dev/null
[ -d /tmp/ptg/logs ] && tar czf "$OUT"/peer_torchtitan_gpu_logs.tgz -C /tmp/ptg logs
left=$((TOTAL_S - SECONDS))
echo "the checks ($CHECKS) get $left s"
if [ "$left" -gt 90 ]; then
    timeout "$left" "$PYTHON" benchmarks/gpu_checks.py "${checks[@]}" --only "$CHECKS" --budget-s $((left - 15)) \
        --out /tmp/gpu_checks
fi
cp /tmp/gpu_checks/gpu_checks.md /tmp/gpu_checks/gpu_checks.json /tmp/gpu_checks/gpu_checks.log "$OUT"/ 2>/dev/null
[ -d /tmp/gpu_checks/profiles ] && tar czf "$OUT"/gpu_checks_profiles.tgz -C /tmp/gpu_checks profiles
ls -la "$OUT"
