#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU (CI has none): the engine end to end on the GPU
# (tests/test_cuda_engine.py), the Triton kernels against their torch twins (tests/test_kernels.py,
# tests/test_quant_triton.py), CUDA graphs against the eager runner (tests/test_cuda_graphs.py), then the decode
# step of a 1.1B random Llama (dense, int8, int4), the quantized linears against the memory roofline, their launch
# settings (a sweep), and the decode step again with the sweep's choices.
#
#   bash benchmarks/cuda_checks.sh            # logs under $OUT (default /tmp/duet-cuda-checks)
#
# It uses the python3 on the PATH (torch with CUDA, triton, transformers, pytest, pytest-xdist, scipy, hypothesis;
# plus duet's own dependencies: `pip install -e .[test]` without torch, or wheels on a machine without an index).
# Each part has its own time limit, so one that hangs does not hide the others.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/duet-cuda-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the benchmarks import the repo's packages
status=0

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

timeout "${TEST_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    tests/test_cuda_engine.py tests/test_kernels.py tests/test_quant_triton.py tests/test_cuda_graphs.py \
    >"$OUT/tests.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -30

timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/decode_step_cuda.py --quantization none int8 int4 \
    --batch 1 8 32 --repeats 20 >"$OUT/decode_step.log" 2>&1 || status=1
tail -25 "$OUT/decode_step.log"

timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/quant_triton_bench.py --dtype bfloat16 --rows 1 8 32 512 \
    --repeats 20 >"$OUT/quant_triton.log" 2>&1 || status=1
tail -40 "$OUT/quant_triton.log"

timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/quant_triton_bench.py --dtype bfloat16 --sweep --repeats 10 \
    --best "$OUT/best.json" >"$OUT/quant_sweep.log" 2>&1 || status=1
grep -A10 "geometric\|by rows\|best:" "$OUT/quant_sweep.log"

# the decode step again with the sweep's choices, next to the tree's own settings
if [ -f "$OUT/best.json" ]; then
    timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/decode_step_cuda.py --quantization int8 int4 --batch 1 8 32 \
        --repeats 20 --tiles "$OUT/best.json" >"$OUT/decode_step_tiles.log" 2>&1 || status=1
    grep "cuda graphs" "$OUT/decode_step_tiles.log"
fi
exit $status
