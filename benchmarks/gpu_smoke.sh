#!/usr/bin/env bash
# The GPU fallback, end to end on one GPU host (`pip install 'posttrain[cuda]'`):
#   bash benchmarks/gpu_smoke.sh                      # results under $OUT (default /tmp/gpu_smoke)
# 1. the backend, 2. the GPU-only tests (cuDNN attention, MLA/MoE decoding, HF parity on GPU),
# 3. the tiny SFT config through the CLI, 4. SFT steps of a 1B-class model (Llama 3.2 1B shapes,
# bf16 compute, AdamW, packed rows of 2048), 5. generation. Prints tokens/s and MFU (the
# metrics' MFU uses the chip's dense bf16 peak from posttrain/train/_metrics.py).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_smoke}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

echo "== GPU tests"
# float32 parity needs full-precision matmuls (XLA:GPU uses TF32 by default).
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 python3 -m pytest -p no:cacheprovider -q -rs \
  tests/models/test_attention.py tests/models/test_hf.py \
  "tests/models/test_moe_model.py::test_cached_decoding_matches_the_full_pass" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -6

summary() {  # median tokens/s and MFU of a run's logged train steps, past the compile
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
train = [r for r in rows if r["split"] == "train"][2:]
tps = statistics.median(r["tokens_per_second"] for r in train)
mfu = statistics.median(r.get("mfu", float("nan")) for r in train)
print(f"{sys.argv[2]}: {tps:,.0f} tokens/s, MFU {100 * mfu:.1f}%, final loss {train[-1]['loss']:.3f}")
PY
}

echo "== tiny SFT (configs/sft.py:tiny)"
rm -rf "$OUT/sft_tiny"
timeout 180 python3 -m posttrain.cli train --config=configs/sft.py:tiny \
  --config.train.steps=300 --config.train.progress=False --config.train.eval_every=0 \
  --workdir="$OUT/sft_tiny" 2>&1 | grep -E "finished|Error" | tail -3
summary "$OUT/sft_tiny" "tiny SFT"

echo "== 1B-class SFT (llama3_1b shapes, random init, batch 8 x 2048, bf16 compute)"
rm -rf "$OUT/sft_1b"
timeout 240 python3 -m posttrain.cli train --config=configs/sft.py:tiny \
  --config.model.preset=llama3_1b --config.model.remat=none --config.data.max_len=2048 \
  --config.data.batch_size=8 --config.train.steps=30 --config.train.log_every=1 \
  --config.train.eval_every=0 --config.train.progress=False \
  --config.checkpoint.every=1000 --config.optimizer.learning_rate=3e-4 \
  --workdir="$OUT/sft_1b" 2>&1 | grep -E "finished|Error" | tail -3
summary "$OUT/sft_1b" "1B SFT"

echo "== generation (posttrain static and continuous batching vs HF generate)"
timeout 150 python3 benchmarks/generate_throughput.py --batch=32 --prompt=128 --new=256 \
  --requests=64 --repeats=1 2>&1 | grep -v Warning | tee "$OUT/generate.log" | tail -8
