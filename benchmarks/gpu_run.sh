#!/usr/bin/env bash
# One device session, in three parts, each in its own process under its own timeout so
# a kernel that hangs or crashes costs only its part: (1) accuracy of the flash kernels
# against the f32 reference, (2) the TFLOP/s table (and the Triton launch-option sweep
# with ATTN_ARGS=" "), (3) when every check passed, a real-size GRPO step with the
# default flash kernels and with all three Mosaic GPU kernels. Results land in $OUT
# (JSON + logs).
#   bash benchmarks/gpu_run.sh   (on a machine with a GPU; wheels in .whl/ if carried)
# Knobs: CHECKS (substrings of the accuracy checks' names, "" = all), ARMS (table arms,
# see `python -m benchmarks.attention --help`), CHECK/ATTN/STEP_TIMEOUT (seconds),
# ATTN_ARGS, STEP_ARGS.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/env.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
CHECKS=${CHECKS-}
timeout "${CHECK_TIMEOUT:-240}" python3 -c "
import json, sys
from benchmarks import attention
only = [x for x in sys.argv[1].split(',') if x] or None
json.dump(attention.accelerator_check(only=only), open(sys.argv[2], 'w'))" \
  "$CHECKS" "$OUT/checks.json" 2>&1 | tee "$OUT/checks.log"
echo "checks exit ${PIPESTATUS[0]}" | tee -a "$OUT/checks.log"
timeout "${ATTN_TIMEOUT:-240}" python3 -m benchmarks.attention --accelerator-only --checks "" \
  --arms "${ARMS:-flash (pallas),flash mosaic,flash triton,flash alibi,jax xla,jax cudnn}" \
  --out "$OUT/attention.json" ${ATTN_ARGS:---no-sweep} 2>&1 | tee "$OUT/attention.log"
echo "table exit ${PIPESTATUS[0]}" | tee -a "$OUT/attention.log"
if [ ! -s "$OUT/checks.json" ] || grep -qE '"FAIL"|failed' "$OUT/checks.json"; then
  echo "step skipped: an accuracy check failed or did not finish" | tee "$OUT/step.log"
  exit 1
fi
timeout "${STEP_TIMEOUT:-220}" python3 -m benchmarks.gpu_step --steps 2 --tuned "$OUT/attention.json" \
  --out "$OUT/step.json" ${STEP_ARGS:---impls=flash --no-rollout \
  --flash-arms=gpu_forward=mosaic,gpu_backward=mosaic} 2>&1 | tee "$OUT/step.log"
echo "step exit ${PIPESTATUS[0]}" | tee -a "$OUT/step.log"
