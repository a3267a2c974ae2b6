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
# Order: issue 15's Llama 3 8B cases first (benchmarks/gpu_checks.py --only 8B: QLoRA and LoRA, and the model cut to
# 8 blocks in full fine-tuning, LoRA and QLoRA), with up to GPU_CHECKS_S; then the comparison with torchtitan
# (benchmarks/peer_torchtitan_gpu.py, one repetition: eager and compiled blocks, Llama 3.2 1B's shape), with what
# is left of TOTAL_S. Each script rewrites its table after every case or run, so what finished comes back even
# if the rest runs out of time. At most 8 files come back from $OUT: the two tables, the two JSON files, the
# 8B log and the comparison's logs in one archive.
#
# Checked on the CPU with torch 2.11 (the machine's) and these wheels: each script's --smoke. Not yet run on a GPU:
# no device was lent to a session until 2026-11-28, and that day's call was refused ("no new device machine is
# lent at present").
#
# SMOKE=1 runs both scripts' --smoke (small models on the CPU: the plumbing), with PYTHON and WHL (the wheels' folder,
# which must suit that Python) set for this machine.
set -u
TOTAL_S=${TOTAL_S:-570}
GPU_CHECKS_S=${GPU_CHECKS_S:-320}
OUT=${OUT:-/tmp/gpu_session}
PYTHON=${PYTHON:-python3}
WHL=${WHL:-.whl}
if [ "${SMOKE:-0}" = 1 ]; then checks=(--smoke); peer=(--smoke); else checks=(--only 8B); peer=(); fi
mkdir -p "$OUT"
rm -rf /tmp/site /tmp/ptg
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PYTHON" -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
timeout $((GPU_CHECKS_S + 10)) "$PYTHON" benchmarks/gpu_checks.py "${checks[@]}" --budget-s "$GPU_CHECKS_S" --out "$OUT"
left=$((TOTAL_S - SECONDS))
echo "the torchtitan comparison gets $left s"
if [ "$left" -gt 120 ]; then
    timeout "$left" "$PYTHON" benchmarks/peer_torchtitan_gpu.py "${peer[@]}" --reps 1 --budget-s $((left - 15)) \
        --out /tmp/ptg
fi
cp /tmp/ptg/peer_torchtitan_gpu.md /tmp/ptg/peer_torchtitan_gpu.json "$OUT"/ 2>/dev/null
[ -d /tmp/ptg/logs ] && tar czf "$OUT"/peer_torchtitan_gpu_logs.tgz -C /tmp/ptg logs
ls -la "$OUT"
