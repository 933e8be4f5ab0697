#!/usr/bin/env bash
# The one script to run on a single H100/H200 machine (docs/testing.md): the preflight, build
# tpkernels._C in place, the main job as users run it (torchrun, NCCL, --layout auto --autotune 2 on
# packed text) and its step 0 against fp64, the `cuda`-marked tests, the GPU benchmarks (TP and CP
# through the virtual-rank harness among them), then the roofline's measured column.
#
#   bash benchmarks/gpu_check.sh                      # on the GPU machine
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh  # anywhere (automatic without a GPU): every CUDA step
#       prints "skipped: <reason>"; the script's syntax, the preflight, the main job's command line
#       (tpkernels train --dry-run, same flags) and the roofline run on the CPU (tests/test_gpu_check_dry_run.py)
#   GPU_CHECK_ARCHIVE=$OUT/gpu_check.tgz OUT=/tmp/gpu_check bash benchmarks/gpu_check.sh
#       # everything in one archive, refreshed as each step ends (the device tool brings back 8 files
#       # at most); the archive must lie outside OUT
#
# Writes logs and CSVs to $OUT if set (the device tool's output folder), else benchmarks/results/ (a
# temporary folder in a dry run), and $OUT/steps.tsv: one line per step (status, seconds, note),
# written as the step ends. Uses the machine's own python3 and packages (no venv, no network).
# Budget: under 9 minutes (GPU_CHECK_BUDGET_S, default 540 s: the device tool allows 600 s a call).
set -uo pipefail
cd "$(dirname "$0")/.."
SCRIPT="benchmarks/gpu_check.sh"
PY="${PYTHON:-python3}"
status=0
step() { echo; echo "=== $1 ($(date +%T))"; }

# ---- a dry run without a GPU (or when asked): CUDA steps print why they are skipped
DRY=""
if [ "${GPU_CHECK_DRY_RUN:-0}" = "1" ]; then
  DRY="dry run (GPU_CHECK_DRY_RUN=1)"
elif ! command -v nvidia-smi > /dev/null 2>&1; then
  DRY="no GPU here (no nvidia-smi)"
elif ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
  DRY="no GPU here (torch.cuda.is_available() is False)"
fi
if [ -n "$DRY" ] && [ -z "${OUT:-}" ]; then OUT="$(mktemp -d /tmp/gpu_check_dry.XXXXXX)"; fi
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
export OUT

# one budget for the whole script: every step's timeout is capped by what is left, less RESERVE_S kept
# for the roofline and the summary at the end, so the late steps shrink instead of the call being killed
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))
RESERVE_S=20
cap() { local left=$((deadline - RESERVE_S - SECONDS)); if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi; }

# each step's result, as it ends: $OUT/steps.tsv (and the archive, if asked for)
STEPS="$OUT/steps.tsv"
printf 'step\tstatus\tseconds\tnote\n' > "$STEPS"
record() {  # record NAME STATUS SECONDS [NOTE]
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$STEPS"
  if [ -n "${GPU_CHECK_ARCHIVE:-}" ]; then
    tar czf "$GPU_CHECK_ARCHIVE.part" -C "$OUT" . && mv "$GPU_CHECK_ARCHIVE.part" "$GPU_CHECK_ARCHIVE"
  fi
}
# run_step NAME SECONDS LOG CMD...: CMD under timeout (capped), its output to $OUT/LOG and to the console
# its last TAIL lines (default 15), or its first HEAD lines if HEAD is set; its result to steps.tsv;
# returns CMD's exit code
run_step() {
  local name=$1 secs=$2 log=$3 t0=$SECONDS limit rc
  shift 3
  step "$name"
  limit=$(cap "$secs")
  if [ -n "${HEAD:-}" ]; then  # sed reads to the end: no SIGPIPE for the command
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" | sed -n "1,${HEAD}p"
  else
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" | tail -n "${TAIL:-15}"
  fi
  rc=${PIPESTATUS[0]}
  case $rc in
    0) record "$name" ok $((SECONDS - t0)) "$log" ;;
    124) echo "TIMED OUT after ${limit} s (see $OUT/$log)"; record "$name" "timeout ${limit}s" $((SECONDS - t0)) "$log" ;;
    *) echo "FAILED with exit code $rc (see $OUT/$log)"; record "$name" "failed ($rc)" $((SECONDS - t0)) "$log" ;;
  esac
  return "$rc"
}
# gpu_step NAME SECONDS LOG CMD...: run_step, or in a dry run "skipped: <reason>"
gpu_step() {
  if [ -n "$DRY" ]; then step "$1"; echo "skipped: $DRY"; record "$1" skipped 0 "$DRY"; return 0; fi
  run_step "$@" || { status=1; return 1; }
}
# dry_check NAME LOG FLAGS...: in a dry run, queue `python -m tpkernels.train FLAGS --dry-run` (the CLI's own
# checks: config, layout plan, data); dry_checks_run runs the queue in one process (each command's output to
# $OUT/LOG, its first 4 lines to the console, its result to steps.tsv as a step of its own): one start-up of
# torch, transformers and the planner instead of one per command (~5 s each on 2 CPU cores)
DRY_Q="$OUT/.dry_checks"
if [ -n "$DRY" ]; then rm -rf "$DRY_Q"; fi  # a queue an interrupted dry run left in this OUT
dry_check() {
  [ -n "$DRY" ] || return 0
  local name=$1 log=$2 n
  shift 2
  mkdir -p "$DRY_Q"
  n=$(find "$DRY_Q" -name '*.args' | wc -l)
  printf '%s\t%s\n' "$name" "$log" > "$DRY_Q/$n.what"
  printf '%s\0' "$@" --dry-run > "$DRY_Q/$n.args"
}
dry_checks_run() {
  [ -n "$DRY" ] && [ -d "$DRY_Q" ] || return 0
  local n name log rc secs
  # a file, not stdin: a process the checks spawn (multiprocessing) imports the main module again
  cat > "$DRY_Q/run.py" <<'PY'
import contextlib, os, sys, time, warnings
from pathlib import Path

if __name__ == "__main__":
    from tpkernels.train.cli import main

    queue, out = Path(sys.argv[1]), Path(sys.argv[2])
    for n in range(len(list(queue.glob("*.args")))):
        log = (queue / f"{n}.what").read_text().rstrip("\n").split("\t")[1]
        argv = (queue / f"{n}.args").read_bytes().decode().split("\0")[:-1]
        t0 = time.monotonic()
        os.environ.pop("TPK_TRAIN_SAID_WARNINGS", None)  # each command says its warnings, as its own process would
        with open(out / log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f), \
                warnings.catch_warnings():
            try:
                rc = main(argv)
            except BaseException as e:  # noqa: BLE001  (a crash is this command's failure, not the queue's)
                print(f"{type(e).__name__}: {e}")
                rc = 1
        (queue / f"{n}.rc").write_text(f"{rc or 0} {time.monotonic() - t0:.0f}")
PY
  TPKERNELS_CACHE_DIR="$CKPT/planner_cache" timeout "$(cap 300)" $PY "$DRY_Q/run.py" "$DRY_Q" "$OUT"
  for n in $(seq 0 $(($(find "$DRY_Q" -name '*.args' | wc -l) - 1))); do
    IFS=$'\t' read -r name log < "$DRY_Q/$n.what"
    step "$name"
    sed -n 1,4p "$OUT/$log" 2> /dev/null
    if [ -f "$DRY_Q/$n.rc" ]; then read -r rc secs < "$DRY_Q/$n.rc"; else rc=124; secs=0; fi
    case $rc in
      0) record "$name" ok "$secs" "$log" ;;
      124) echo "TIMED OUT (the dry-run checks' process)"; record "$name" timeout "$secs" "$log"; status=1 ;;
      *) echo "FAILED with exit code $rc (see $OUT/$log)"; record "$name" "failed ($rc)" "$secs" "$log"; status=1 ;;
    esac
  done
  rm -rf "$DRY_Q"
}

step "machine"
if [ -n "$DRY" ]; then
  echo "skipped: $DRY: the CUDA steps are skipped; what the CPU can check runs"
  record machine skipped 0 "$DRY"
else
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu_info.csv"
  record machine ok 0 gpu_info.csv
fi
# packages the image lacks travel as wheels in .whl/ (carried by the device tool; see its README)
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || { echo "installing .whl/ failed"; exit 1; }
fi

run_step "this script's syntax (bash -n)" 10 syntax.log bash -n "$SCRIPT" || exit 1
if ! run_step "preflight (versions, every module imports, a Triton kernel, a collective; stops here on failure)" \
    60 preflight.log env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" $PY benchmarks/preflight.py; then
  echo "PREFLIGHT FAILED: see $OUT/preflight.log"; exit 1
fi
[ "${PREFLIGHT_ONLY:-0}" = "1" ] && { echo "PREFLIGHT_ONLY=1: stopping after the preflight"; exit 0; }

export MAX_JOBS="${MAX_JOBS:-$(nproc)}" TPKERNELS_CUDA_ARCHS="${TPKERNELS_CUDA_ARCHS:-80;90}"
if ! TAIL=2 gpu_step "build tpkernels._C (in place)" 150 build.log $PY setup.py build_ext --inplace; then
  echo "BUILD FAILED (tail of $OUT/build.log):"; tail -40 "$OUT/build.log"; exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
gpu_step "preflight after the build (tpkernels._C loads with CUDA)" 30 preflight_built.log \
  $PY benchmarks/preflight.py --built || { echo "PREFLIGHT FAILED after the build"; exit 1; }
TAIL=40 gpu_step "tpkernels info" 30 tpkernels_info.txt $PY -m tpkernels.cli info

# ---- the main job as users run it: one GPU under torchrun, so every host-side collective meets NCCL;
# the planner picks the layout and autotune measures its best 2 (and the config's own) in the first
# steps; packed text (this README, byte-level tokens, documents packed into rows); the demo's model
# (4 layers, hidden 128) in bf16 with fp32 masters, 20 steps, a checkpoint at the end; every step's
# metrics appended to $OUT/train_nccl_metrics.jsonl as it ends
CKPT="$(mktemp -d /tmp/tpk_gpu_check_ckpt.XXXXXX)"
# the planner's per-machine corrections that autotune fits: this check's own, never the user's
TRAIN=(env TPKERNELS_CACHE_DIR="$CKPT/planner_cache" $PY)
MAIN_JOB=(--config python/configs/demo_llama_tp2_pp2.yaml --parallel.tp 1 --parallel.pp 1
          --parallel.sequence_parallel false --layout auto --autotune 2 --data.source README.md
          --training.precision bf16 --training.steps 20 --checkpoint.save_dir "$CKPT/main"
          --logging.progress false)
# the same flags through the CLI's own checks: config, layout plan, data
dry_check "main job's command line (tpkernels train --dry-run, the same flags)" train_nccl_dry_run.log \
  "${MAIN_JOB[@]}" --logging.metrics_file "$OUT/train_nccl_metrics.jsonl"
TAIL=8 gpu_step "main job: torchrun --standalone --nproc-per-node 1 (NCCL), --layout auto --autotune 2, packed text" \
  120 train_nccl.log "${TRAIN[@]}" -m torch.distributed.run --standalone --nproc-per-node 1 -m tpkernels.train "${MAIN_JOB[@]}" \
  --logging.metrics_file "$OUT/train_nccl_metrics.jsonl"
# step 0 against the single-process fp64 model on the whole batch (--verify-step0 is a --nproc option:
# the same flags through torch's elastic launcher, NCCL too, one step at the planner's layout; checked
# on the CPU with gloo: "step 0 loss 6.251701 at TP1 PP1 DP1 mbs8 vs 6.251713 ...: equal")
STEP0=(--nproc 1 --verify-step0 "${MAIN_JOB[@]}" --autotune 0 --training.steps 1 --optimizer.warmup_steps 0
       --checkpoint.save_dir "$CKPT/step0")
dry_check "step 0 check's command line (tpkernels train --dry-run, the same flags)" train_step0_dry_run.log \
  "${STEP0[@]}"
TAIL=3 gpu_step "main job's step 0 vs fp64 (tpkernels train --nproc 1 --verify-step0)" 60 train_step0.log \
  "${TRAIN[@]}" -m tpkernels.train "${STEP0[@]}"
# ---- fine-tuning as users run it, one GPU under torchrun (NCCL), a few steps each: chat SFT (the loss on
# the assistant tokens only), then DPO with LoRA on preference pairs (its reference computed once by a
# forward pass over the pairs and cached), on the tiny corpus python/chat_data.py writes (a word-level
# tokenizer with a real chat template, a random Llama), then QLoRA on the SFT records (the same flags,
# an NF4 base quantised from model.init_from as it is read, LoRA rank 16 adapters). JSONL records need
# `datasets`, which the GPU image lacks: its wheels travel in .whl/ (`pip download --no-deps -d .whl
# datasets dill multiprocess`, then `carry` .whl), installed above; without them the three steps are
# skipped and say so.
CHAT="$CKPT/chat"
FT=(--model.init_from "$CHAT/model" --model.name "$CHAT/model" --data.tokenizer "$CHAT/tokenizer"
    --data.seq_length 64 --training.precision bf16 --training.steps 8 --parallel.micro_batch_size 8
    --logging.progress false --logging.log_every 2)
SFT=("${FT[@]}" --data.source "$CHAT/sft.jsonl")
DPO=("${FT[@]}" --data.source "$CHAT/pairs.jsonl" --model.finetune lora --dpo.cache_dir "$CKPT/dpo_reference")
QLORA=("${SFT[@]}" --model.finetune qlora --model.quant nf4 --model.lora_rank 16)
if $PY -c "import datasets" 2> /dev/null; then
  run_step "chat corpus (python/chat_data.py: tokenizer with a chat template, random Llama, SFT and DPO records)" 30 \
    chat_data.log $PY python/chat_data.py "$CHAT" || status=1
  dry_check "SFT's command line (tpkernels train --dry-run, the same flags)" train_sft_dry_run.log "${SFT[@]}"
  dry_check "DPO's command line (tpkernels train --dry-run, the same flags)" train_dpo_dry_run.log "${DPO[@]}"
  dry_check "QLoRA's command line (tpkernels train --dry-run, the same flags)" train_qlora_dry_run.log "${QLORA[@]}"
  TAIL=4 gpu_step "SFT: torchrun --nproc-per-node 1 (NCCL), chat records, assistant tokens only" 60 train_sft.log \
    "${TRAIN[@]}" -m torch.distributed.run --standalone --nproc-per-node 1 -m tpkernels.train "${SFT[@]}" \
    --logging.metrics_file "$OUT/train_sft_metrics.jsonl"
  TAIL=4 gpu_step "DPO: torchrun --nproc-per-node 1 (NCCL), LoRA, cached reference" 60 train_dpo.log \
    "${TRAIN[@]}" -m torch.distributed.run --standalone --nproc-per-node 1 -m tpkernels.train "${DPO[@]}" \
    --logging.metrics_file "$OUT/train_dpo_metrics.jsonl"
  TAIL=4 gpu_step "QLoRA: torchrun --nproc-per-node 1 (NCCL), NF4 base from init_from, LoRA r16, chat records" 60 \
    train_qlora.log "${TRAIN[@]}" -m torch.distributed.run --standalone --nproc-per-node 1 -m tpkernels.train \
    "${QLORA[@]}" --logging.metrics_file "$OUT/train_qlora_metrics.jsonl"
else
  for what in "SFT: torchrun (NCCL), chat records" "DPO: torchrun (NCCL), LoRA, cached reference" \
      "QLoRA: torchrun (NCCL), NF4 base, LoRA r16"; do
    step "$what"; echo "skipped: datasets is not installed (its wheels go in .whl/: see above)"
    record "$what" skipped 0 "datasets is not installed"
  done
fi
# ---- FP8 training as users run it: one GPU under torchrun (NCCL), training.precision fp8 with fp8.layers
# auto: the planner's GEMM model (this GPU's preset: FP8 and bf16 peaks, HBM for the casts) picks the
# decoder linears that run FP8, and rank 0 prints its per-linear table (layer, GEMM, predicted bf16 and
# fp8 ms, gain, chosen, why) before step 0; the metrics file keeps it (fp8_choice) and every step's
# record carries the guardrail's fp8/saturated, fp8/underflow, fp8/linears. A model wide enough for FP8
# to pay on some linears (hidden 2048, ffn 5632, 4 layers, 16/8 heads; 4 x 1024 tokens of packed README
# text a step: on the H200 preset qkv 1.11x, gate_up 1.22x, down 1.15x run FP8 and out, 1.01x, stays
# bf16), 8 steps, no checkpoint (0.19B params: ~3 GB with masters and AdamW state); fp8.learn (on by
# default) times each kind of linear in bf16 and FP8 after step 0 into this check's own planner cache
FP8_JOB=(--config python/configs/demo_llama_tp2_pp2.yaml --parallel.tp 1 --parallel.pp 1
         --parallel.sequence_parallel false --model.hidden 2048 --model.ffn 5632 --model.heads 16
         --model.kv_heads 8 --data.source README.md --data.seq_length 1024 --parallel.micro_batch_size 4
         --parallel.num_microbatches 1 --training.precision fp8 --fp8.layers auto --training.steps 8
         --checkpoint.save_dir none --logging.progress false --logging.log_every 2)
dry_check "FP8 job's command line (tpkernels train --dry-run, the same flags)" train_fp8_dry_run.log "${FP8_JOB[@]}"
dry_checks_run  # the queued dry-run checks above, in one process
TAIL=16 gpu_step "FP8: torchrun --nproc-per-node 1 (NCCL), training.precision fp8, fp8.layers auto (the choice table)" \
  60 train_fp8.log "${TRAIN[@]}" -m torch.distributed.run --standalone --nproc-per-node 1 -m tpkernels.train \
  "${FP8_JOB[@]}" --logging.metrics_file "$OUT/train_fp8_metrics.jsonl"
rm -rf "$CKPT"

gpu_step "cuda-marked tests (all but attention)" 100 gpu_tests.log \
  $PY -m pytest tests -m cuda -q --timeout "$(cap 60)" -p no:cacheprovider --ignore tests/test_gpu_attention.py \
  --ignore tests/test_gpu_models.py --ignore tests/test_gpu_gemm_comm.py --junitxml="$OUT/gpu_tests.xml"
gpu_step "cuda-marked fused GEMM-comm tests (virtual TP on this GPU; NCCL + symmetric memory when >= 2 GPUs)" 120 \
  gpu_gemm_comm_tests.log $PY -m pytest tests/test_gpu_gemm_comm.py -m cuda -q --timeout "$(cap 100)" \
  -p no:cacheprovider --junitxml="$OUT/gpu_gemm_comm_tests.xml"
gpu_step "cuda-marked attention tests (Triton compiles one config per variant: ~40 kernels)" 180 \
  gpu_attention_tests.log $PY -m pytest tests/test_gpu_attention.py -m cuda -q --timeout "$(cap 120)" \
  -p no:cacheprovider --junitxml="$OUT/gpu_attention_tests.xml"
gpu_step "cuda-marked model tests (Llama, GPT-2, Mistral in bf16: our model and apply_kernels vs float64)" 120 \
  gpu_model_tests.log $PY -m pytest tests/test_gpu_models.py -m cuda -q --timeout "$(cap 100)" \
  -p no:cacheprovider --junitxml="$OUT/gpu_model_tests.xml"

# ---- benchmarks (their CSVs fill the roofline's measured column at the end)
# attention at the key shapes of the issue's targets (bf16, headdim 128, seqlen >= 2k), autotuned
TAIL=30 gpu_step "bench: attention (hd128, s 2k/8k, bf16)" 100 bench_attention.log \
  $PY benchmarks/bench_attention.py --headdims 128 --seqlens 2048 8192 --name attention_key_shapes
# RMSNorm, SwiGLU, rotary, linear_cross_entropy at Llama-3-8B widths, bf16
TAIL=30 gpu_step "bench: Llama ops" 60 bench_llama_ops.log $PY benchmarks/bench_llama_ops.py --reps 5
# LayerNorm (GPT-2 widths, with and without the residual add), bf16
TAIL=20 gpu_step "bench: LayerNorm" 40 bench_norms.log $PY benchmarks/bench_norms.py --reps 5
TAIL=30 gpu_step "bench: NF4 GEMM (dequantised in registers) vs bf16 cuBLAS" 60 bench_nf4.log \
  $PY benchmarks/bench_nf4.py --device cuda --reps 5
# a whole QLoRA step (NF4 and int8 base) vs LoRA vs full fine-tuning, one process, bf16, interleaved steps:
# step time ratios, base bytes per param, the step's peak (max_memory_allocated) above what it starts with
TAIL=8 gpu_step "bench: QLoRA vs LoRA vs full fine-tuning step (bf16, hidden 1024, 4 layers)" 60 bench_qlora.log \
  $PY benchmarks/bench_qlora.py --device cuda --quick
# FP8 vs bf16: per-linear GEMM TFLOP/s at Llama-3-8B (TP1) and Llama-3-70B (TP8) per-rank shapes, M = 8192,
# on pre-cast operands and with the casts (target: FP8 >= 1.5x bf16), the planner's prediction beside each;
# then one training step of a hidden-2048 Llama in bf16 vs fp8 (fp8.layers all; target >= 1.25x)
TAIL=40 gpu_step "bench: FP8 vs bf16 GEMMs (Llama-3-8B/70B shapes) and one training step" 60 bench_fp8.log \
  $PY benchmarks/bench_fp8.py --device cuda
# the planner's GEMM model by shape: torch.matmul bf16 at every linear GEMM of Llama-3-8B/70B per TP rank (TP 1-8,
# 2k/8k tokens) and squares 256-16384, against the model with the largest square's rate as its ceiling
TAIL=6 gpu_step "bench: planner GEMM model vs measured GEMMs by shape" 60 planner_gemm_shapes.log \
  $PY benchmarks/planner_gemm_shapes.py --reps 5
TAIL=30 gpu_step "bench: bias_gelu" 40 bench_bias_gelu.log $PY benchmarks/bench_bias_gelu.py --sizes 1 16 64
# MoE kernels: the Triton grouped GEMM / expert SwiGLU MLP / permutation against a matmul per expert, a
# padded bmm and torch's grouped_mm (bf16, 8 experts, 8192 tokens top-2, hidden 4096, expert FFN 2048)
TAIL=12 gpu_step "bench: MoE kernels (grouped GEMM vs per-expert matmuls, padded bmm, torch grouped_mm)" 60 \
  bench_moe_kernels.log $PY benchmarks/bench_moe.py --section kernels --device cuda --reps 5 --k-tokens 8192 \
  --k-experts 8 --k-hidden 4096 --k-ffn 2048
# TP through the virtual-rank harness: fused AG+GEMM / GEMM+RS / GEMM+AR at Flux's and Llama-3-70B's TP=8
# shapes, every emulated rank's kernels at once on this GPU
TAIL=12 gpu_step "bench: GEMM + TP comm, virtual TP=8" 90 bench_gemm_comm.log \
  $PY benchmarks/bench_gemm_comm.py --mode virtual --reps 5
# CP through the virtual-rank harness: every CP rank's attention forward in turn (zigzag vs the plain
# ring), Llama-3-8B heads (32/8, headdim 128) at a 32k sequence; target: zigzag at CP 8 >= 90% of the
# whole sequence's attention rate / 8 (ring-flash-attention: zigzag 93.6%, plain ring 68.8% on 8×H800)
TAIL=6 gpu_step "bench: context parallel, virtual CP 2/4/8" 60 bench_context_parallel.log \
  $PY benchmarks/bench_context_parallel.py --mode virtual --seq 32768 --cp 2 4 8 --reps 5
# the other movers at Flux's shapes: copy kernel, push reduce-scatter; CUDA reducer
TAIL=4 gpu_step "bench: GEMM + TP comm movers (copy kernel, push RS)" 40 bench_gemm_comm_movers.log \
  $PY benchmarks/bench_gemm_comm.py --reps 5 --mode virtual --shapes flux --copy kernel --rs-mode push --tag copy_kernel_push
TAIL=4 gpu_step "bench: GEMM + TP comm movers (CUDA reducer)" 40 bench_gemm_comm_reducer.log \
  $PY benchmarks/bench_gemm_comm.py --reps 5 --mode virtual --shapes flux --reducer cuda --tag cuda_reducer
# a whole training step: transformers (SDPA) vs transformers + apply_kernels vs ParallelTransformer, 2 Llama-3-8B layers
TAIL=8 gpu_step "bench: models" 60 bench_models.log $PY benchmarks/bench_models.py --reps 3

# ---- the roofline: every kernel's floor on the H100-SXM and the H200, and what the benchmarks above
# measured against it (CPU only: runs in a dry run too, with the measured column empty)
RESERVE_S=0
TAIL=60 run_step "roofline (floors, and the measured column from the CSVs above)" 20 roofline.log \
  $PY benchmarks/roofline.py --measured "$OUT" --out "$OUT" || status=1

step "done: status $status ($((SECONDS)) s; $OUT/steps.tsv)"
column -t -s $'\t' "$STEPS" 2> /dev/null || cat "$STEPS"
exit $status
