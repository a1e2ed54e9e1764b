#!/usr/bin/env bash
# One device session: accuracy + TFLOP/s table for the attention kernels (the Triton
# launch-option sweep too with ATTN_ARGS=" "), then a real-size GRPO step with the default
# flash kernels and with both Mosaic GPU kernels. Results land in $OUT (JSON + log).
#   bash benchmarks/gpu_run.sh   (on a machine with a GPU; wheels in .whl/ if carried)
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv | tee "$OUT/env.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$OUT/env.txt"
timeout "${ATTN_TIMEOUT:-300}" python3 -m benchmarks.attention --accelerator-only \
  --out "$OUT/attention.json" ${ATTN_ARGS:---no-sweep} 2>&1 | tee "$OUT/attention.log"
timeout "${STEP_TIMEOUT:-220}" python3 -m benchmarks.gpu_step --steps 2 --tuned "$OUT/attention.json" \
  --out "$OUT/step.json" ${STEP_ARGS:---impls=flash --no-rollout \
  --flash-arms=gpu_forward=mosaic,gpu_backward=mosaic} 2>&1 | tee "$OUT/step.log"
