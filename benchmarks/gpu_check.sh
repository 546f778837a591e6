#!/usr/bin/env bash
# One prepared run on a lent GPU machine (its image has jax[cuda], torch, transformers):
# the cuDNN attention tests and HF parity on GPU, then the step benchmark. Writes to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__)"
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1
# float32 parity needs full-precision matmuls (XLA:GPU uses TF32 by default).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 300 python3 -m pytest -p no:cacheprovider -q -rs \
  tests/models/test_attention.py tests/models/test_hf.py tests/models/test_transformer.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -25
timeout 240 python3 benchmarks/model_step.py --preset=1b --batch=4 --seq=2048 --steps=10 \
  --json="$OUT/bench_1b.json" 2>&1 | grep -v Warning | tee "$OUT/bench_1b.log" | tail -12
