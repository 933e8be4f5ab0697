#!/usr/bin/env bash
# The one script to run on a single H100/H200 machine (see DESIGN.md §4):
#   build tpkernels._C in place, run the `cuda`-marked tests, run the GPU benchmarks.
# Writes logs and CSVs to $OUT if set (the device tool's output folder), else benchmarks/results/.
# Uses the machine's own python3 and packages (no venv, no network). Budget: under 9 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export OUT
PY="${PYTHON:-python3}"
status=0
step() { echo; echo "=== $1 ($(date +%T))"; }
# one budget for the whole script (the device tool allows 600 s a call): every step's timeout is
# capped by what is left, so the late steps shrink instead of the call being killed
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))
cap() { local left=$((deadline - SECONDS)); if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi; }

step "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu_info.csv" \
  || echo "no nvidia-smi: a dry run without a GPU (the CUDA steps skip)"
# packages the image lacks travel as wheels in .whl/ (carried by the device tool; see its README)
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || { echo "installing .whl/ failed"; exit 1; }
fi

step "preflight (versions, every module imports, a Triton kernel, a collective; stops here on failure)"
if ! timeout $(cap 60) env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $PY benchmarks/preflight.py 2>&1 \
    | tee "$OUT/preflight.log"; then
  echo "PREFLIGHT FAILED: see $OUT/preflight.log"; exit 1
fi
[ "${PREFLIGHT_ONLY:-0}" = "1" ] && { echo "PREFLIGHT_ONLY=1: stopping after the preflight"; exit 0; }

step "build tpkernels._C (in place)"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}" TPKERNELS_CUDA_ARCHS="${TPKERNELS_CUDA_ARCHS:-80;90}"
if ! timeout $(cap 150) $PY setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
  echo "BUILD FAILED (tail of $OUT/build.log):"; tail -40 "$OUT/build.log"; exit 1
fi
tail -2 "$OUT/build.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY benchmarks/preflight.py --built 2>&1 | tee -a "$OUT/preflight.log" || { echo "PREFLIGHT FAILED after the build"; exit 1; }
$PY -m tpkernels.cli info | tee "$OUT/tpkernels_info.txt"

step "cuda-marked tests (all but attention)"
timeout $(cap 100) $PY -m pytest tests -m cuda -q --timeout $(cap 60) -p no:cacheprovider --ignore tests/test_gpu_attention.py \
  --ignore tests/test_gpu_models.py --ignore tests/test_gpu_gemm_comm.py \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "cuda-marked fused GEMM-comm tests (virtual TP on this GPU; NCCL + symmetric memory when >= 2 GPUs)"
timeout $(cap 120) $PY -m pytest tests/test_gpu_gemm_comm.py -m cuda -q --timeout $(cap 100) -p no:cacheprovider \
  --junitxml="$OUT/gpu_gemm_comm_tests.xml" 2>&1 | tee "$OUT/gpu_gemm_comm_tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "cuda-marked attention tests (Triton compiles one config per variant: ~40 kernels)"
timeout $(cap 180) $PY -m pytest tests/test_gpu_attention.py -m cuda -q --timeout $(cap 120) -p no:cacheprovider \
  --junitxml="$OUT/gpu_attention_tests.xml" 2>&1 | tee "$OUT/gpu_attention_tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "cuda-marked model tests (Llama, GPT-2, Mistral in bf16: our model and apply_kernels vs float64)"
timeout $(cap 120) $PY -m pytest tests/test_gpu_models.py -m cuda -q --timeout $(cap 100) -p no:cacheprovider \
  --junitxml="$OUT/gpu_model_tests.xml" 2>&1 | tee "$OUT/gpu_model_tests.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "benchmarks"
timeout $(cap 40) $PY benchmarks/bench_bias_gelu.py --sizes 1 16 64 2>&1 | tee "$OUT/bench_bias_gelu.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# attention at the key shapes of the issue's targets (bf16, headdim 128, seqlen >= 2k), autotuned
timeout $(cap 100) $PY benchmarks/bench_attention.py --headdims 128 --seqlens 2048 8192 --name attention_key_shapes \
  2>&1 | tee "$OUT/bench_attention.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# RMSNorm, SwiGLU, rotary, linear_cross_entropy at Llama-3-8B widths, bf16 (Liger-Kernel too if it imports)
timeout $(cap 60) $PY benchmarks/bench_llama_ops.py --reps 5 2>&1 | tee "$OUT/bench_llama_ops.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# fused AG+GEMM / GEMM+RS / GEMM+AR at Flux's and Llama-3-70B's TP=8 shapes: virtual TP=8 on one GPU
# (every emulated rank's kernels at once), the real ops when >= 2 GPUs are visible
timeout $(cap 90) $PY benchmarks/bench_gemm_comm.py --reps 5 2>&1 | tee "$OUT/bench_gemm_comm.log" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# the other movers at Flux's shapes: copy kernel, push reduce-scatter; CUDA reducer
timeout $(cap 40) $PY benchmarks/bench_gemm_comm.py --reps 5 --mode virtual --shapes flux --copy kernel --rs-mode push \
  --tag copy_kernel_push 2>&1 | tee "$OUT/bench_gemm_comm_movers.log" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout $(cap 40) $PY benchmarks/bench_gemm_comm.py --reps 5 --mode virtual --shapes flux --reducer cuda \
  --tag cuda_reducer 2>&1 | tee -a "$OUT/bench_gemm_comm_movers.log" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# context parallelism on one GPU: every CP rank's attention forward in turn (zigzag vs the plain ring),
# Llama-3-8B heads (32/8, headdim 128) at a 32k sequence; target: zigzag at CP 8 >= 90% of the whole
# sequence's attention rate / 8 (ring-flash-attention: zigzag 93.6%, plain ring 68.8% on 8×H800)
timeout $(cap 60) $PY benchmarks/bench_context_parallel.py --mode virtual --seq 32768 --cp 2 4 8 --reps 5 \
  2>&1 | tee "$OUT/bench_context_parallel.log" | tail -6
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# a whole training step: transformers (SDPA) vs transformers + apply_kernels vs ParallelTransformer, 2 Llama-3-8B layers
timeout $(cap 60) $PY benchmarks/bench_models.py --reps 3 2>&1 | tee "$OUT/bench_models.log" | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# the main job on one GPU: the demo's model in bf16 (fp32 masters), 20 steps, a checkpoint, Triton kernels
timeout $(cap 90) $PY -m tpkernels.train --config python/configs/demo_llama_tp2_pp2.yaml --parallel.tp 1 \
  --parallel.pp 1 --parallel.sequence_parallel false --training.precision bf16 --training.steps 20 \
  --checkpoint.save_dir /tmp/tpk_gpu_ckpt --logging.progress false \
  --logging.metrics_file "$OUT/train_gpu_metrics.jsonl" 2>&1 | tee "$OUT/train_gpu.log" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done: status $status"
exit $status
