#!/usr/bin/env bash
# The issue-10 GPU measurements in one command, each stage a separate process writing its JSON
# into bench/results/ (copied into $OUT too when that is set, e.g. on the device machine).
#
#   bench/gpu_suite.sh                      # decode offline-llama3 offline-llama2 programs
#                                           # ablation json
#   bench/gpu_suite.sh decode programs      # some stages
#   bench/gpu_suite.sh tests                # the GPU tests of the fused kernels (not in "all")
#   bench/gpu_suite.sh profile-llama3 profile-llama2 gemv   # not in "all" either
#
# Stages (rough H100 times, Triton/FlashInfer JIT included on a fresh machine):
#   decode          batch-1 decode of random Llama-2-7B fp16 (128-token prompt, 256 new tokens),
#                   eager / graphs+torch_native / graphs+Triton / graphs+FlashInfer, fused on/off,
#                   % of the HBM floor measured in the same run                        ~3 min
#   offline-llama3  nano-vllm's offline workload (256 seqs) on random Llama-3-8B bf16, the floor
#                   of its own schedule, lmnb vs HF generate on 32 seqs (outputs <= 256) ~2 min
#   offline-llama2  the same on random Llama-2-7B fp16                                   ~2 min
#   programs        bench/programs.py with random Llama-2-7B: radix cache on vs off       ~2 min
#   ablation        bench/engine_ablation.py, random Llama-2-7B fp16: {FlashInfer, Triton} x
#                   graphs on/off x overlap on/off, batch-1 and batch-64 decode against the
#                   floor, 64-seq offline workload against its schedule's floor          ~5 min
#   json            bench/json_decode.py on random Llama-2-7B (vocabulary grown to the
#                   tokenizer's), 32 requests, jump-forward off vs on                    ~2 min
#   profile-llama3  bench/profile_offline.py: torch profiler over 3 windows of the 256-seq
#                   Llama-3-8B bf16 offline run, kernels by category, busy vs wall vs floor
#                                                                    (not in "all")  ~3 min
#   profile-llama2  the same on random Llama-2-7B fp16, for the comparison   (not in "all")  ~3 min
#   gemv            bench/gemv.py --sweep: the batch-1 GEMV kernels     (not in "all")
#   fp8             bench/fp8.py, issue 23's table: random Llama-3-8B bf16 / FP8 weights / FP8
#                   KV / both, batch-1 decode against each one's floor (medians of 5: the
#                   FP8 step spread 2.41-2.46 ms over runs on an H200, 2.33-2.51 at 64 steps
#                   and 3 repeats) and the offline workload;
#                   quality on the embedded SmolLM2 with the GPTQ FP8 checkpoints
#                                                                    (not in "all")  ~8 min
#   fp8-sweep       bench/gemv.py --fp8 --sweep of batch 1's four linears on this device, then
#                   bench/fp8.py's batch-1 decode with its picks (--fp8-gemv-table) instead of
#                   gemv_fp8.TUNED's (whose rows come from an H100 and an H200)
#                                                                    (not in "all")  ~3 min
#   fp8-batches     bench/fp8.py's decode at batch 1-64: bf16, FP8 (2-16 rows on the split-K W8A8
#                   GEMM, swapped operands), FP8 unswapped there (fp8-unswapped-rows), on the
#                   skinny W8A16 kernel (fp8-skinny-rows)          (not in "all")  ~4 min
#   vs-vllm-llama3  bench/vs_vllm.py: lmnb vs vLLM 0.26.0 on random Llama-3-8B bf16, every
#                   workload (offline, shared prefixes as ids and as text, fork, decode b64/b1,
#                   engine start), each engine in its own process       (not in "all")  ~8 min
#   vs-vllm-llama2  the same, offline only, on random Llama-2-7B fp16    (not in "all")  ~4 min
#   vs-vllm         both models in one run (may pass one 10-minute device call) (not in "all")
#                   The vs-vllm stages need vLLM in $VLLM_SITE (default /tmp/vllm-site: run
#                   bench/vllm_peer.sh first) and the Llama-3 tokenizer in .gpu/tokenizer-llama3
#                   (bench/fetch_tokenizers.sh, here); $VS_VLLM_ARGS adds options (e.g.
#                   "--repeats 5 --lmnb-backend triton --profile", "--skip-vllm", or
#                   "--cold-caches": each engine's start as a fresh machine's). vLLM's
#                   flashinfer-python 0.6.14 comes first on their PYTHONPATH, for lmnb too.
# `bash bench/gpu_prep.sh` (here) fills .gpu/deps, .gpu/whl and .gpu/tokenizer.
# FlashInfer: wheels in .gpu/whl are installed into /tmp/site when present (no network); its JIT
# output goes to build/flashinfer (ignored and not carried, so a warm machine keeps it between
# calls that carry .gpu). The tokenizer comes
# from $LMNB_TOKENIZER_DIR or .gpu/tokenizer (SmolLM2's files; random-weight models only need
# it to detokenize).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
TOKENIZER=${LMNB_TOKENIZER_DIR:-.gpu/tokenizer}
RESULTS=bench/results
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
export LMNB_TOKENIZER_DIR=$TOKENIZER
mkdir -p "$RESULTS"

export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# lmnb's own pure dependencies the GPU image lacks (greenlet): wheels for its Python in .gpu/deps
if compgen -G ".gpu/deps/*.whl" >/dev/null && ! $PY -c "import greenlet" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/deps .gpu/deps/*.whl \
    || echo "gpu_suite: could not install the wheels in .gpu/deps"
  export PYTHONPATH=$PYTHONPATH:/tmp/deps
fi
if compgen -G ".gpu/whl/flashinfer_python-*.whl" >/dev/null; then
  if ! PYTHONPATH=/tmp/site:$PYTHONPATH $PY -c "import flashinfer" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl \
      || echo "gpu_suite: could not install the FlashInfer wheels; FlashInfer rows are skipped"
  fi
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$PWD/build/flashinfer}
  mkdir -p "$FLASHINFER_WORKSPACE_BASE"
fi

stages=("$@")
if [ ${#stages[@]} -eq 0 ] || [ "${stages[0]}" = all ]; then
  stages=(decode offline-llama3 offline-llama2 programs ablation json)
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
$PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null \
  || echo "flashinfer: not installed"

VLLM_SITE=${VLLM_SITE:-/tmp/vllm-site}
# bench/vs_vllm.py over some models: vLLM's site folder ahead of /tmp/site (its flashinfer).
vs_vllm() {
  local output=$1; shift
  if [ ! -d "$VLLM_SITE" ]; then
    echo "vs-vllm: no $VLLM_SITE (run bench/vllm_peer.sh first; VS_VLLM_ARGS=--skip-vllm" \
      "runs lmnb alone)"
    [[ " ${VS_VLLM_ARGS:-} " == *" --skip-vllm "* ]] || return 1
  fi
  PYTHONPATH=$PWD:$VLLM_SITE:$PYTHONPATH $PY bench/vs_vllm.py --vllm-site "$VLLM_SITE" \
    --tokenizer-dir "${LLAMA3_TOKENIZER_DIR:-.gpu/tokenizer-llama3}" --output "$output" \
    "$@" ${VS_VLLM_ARGS:-}
}

failed=()
run_stage() {
  local name=$1; shift
  echo
  echo "=== $name: $*"
  local start=$SECONDS
  if "$@"; then
    echo "=== $name done in $((SECONDS - start)) s"
  else
    echo "=== $name FAILED (exit $?) after $((SECONDS - start)) s"
    failed+=("$name")
  fi
  if [ -n "${OUT:-}" ]; then cp "$RESULTS"/*.json "$OUT"/ 2>/dev/null || true; fi
}

for stage in "${stages[@]}"; do
  case $stage in
    decode)
      run_stage decode $PY bench/decode_ablation.py --model-config llama-2-7b \
        --tokenizer "$TOKENIZER" --output "$RESULTS/decode_ablation.json" ;;
    offline-llama3)
      run_stage offline-llama3 $PY bench/offline.py --dummy-config llama-3-8b --device cuda \
        --tokenizer "$TOKENIZER" --hf-num-seqs 32 --hf-max-output-len 256 --hf-batch-size 32 \
        --output "$RESULTS/offline_llama-3-8b.json" ;;
    offline-llama2)
      run_stage offline-llama2 $PY bench/offline.py --dummy-config llama-2-7b --device cuda \
        --tokenizer "$TOKENIZER" --hf-num-seqs 32 --hf-max-output-len 256 --hf-batch-size 32 \
        --output "$RESULTS/offline_llama-2-7b.json" ;;
    programs)
      run_stage programs $PY bench/programs.py --dummy-config llama-2-7b --device cuda \
        --tokenizer "$TOKENIZER" --scale 8 \
        --workloads mmlu,hellaswag,tree-of-thought,chat-short,chat-long \
        --output "$RESULTS/programs_llama-2-7b.json" ;;
    ablation)
      run_stage ablation $PY bench/engine_ablation.py --dummy-config llama-2-7b \
        --tokenizer "$TOKENIZER" --output "$RESULTS/engine_ablation.json" ;;
    json)
      run_stage json $PY bench/json_decode.py --dummy-config llama-2-7b \
        --tokenizer "$TOKENIZER" --num-requests 32 --output "$RESULTS/json_decode.json" ;;
    profile-llama3)
      run_stage profile-llama3 $PY bench/profile_offline.py --dummy-config llama-3-8b \
        --tokenizer "$TOKENIZER" --output "$RESULTS/profile_offline_llama-3-8b.json" ;;
    profile-llama2)
      run_stage profile-llama2 $PY bench/profile_offline.py --dummy-config llama-2-7b \
        --tokenizer "$TOKENIZER" --output "$RESULTS/profile_offline_llama-2-7b.json" ;;
    gemv)
      run_stage gemv $PY bench/gemv.py --sweep --out "$RESULTS/gemv.json" ;;
    fp8)
      run_stage fp8 $PY bench/fp8.py --tokenizer "$TOKENIZER" --repeats 5 \
        --quality-checkpoints fp8-gptq,fp8-gptq-ends ;;
    fp8-sweep)
      run_stage fp8-sweep $PY bench/gemv.py --fp8 --sweep --rows 1 --ops qkv o gate_up down \
        --jobs 16 --out "$RESULTS/gemv_fp8_sweep.json"
      run_stage fp8-sweep-decode $PY bench/fp8.py --tokenizer "$TOKENIZER" --parts decode \
        --variants bf16,fp8 --repeats 5 --fp8-gemv-table "$RESULTS/gemv_fp8_sweep.json" ;;
    fp8-batches)
      run_stage fp8-batches $PY bench/fp8.py --tokenizer "$TOKENIZER" --parts decode \
        --variants bf16,fp8,fp8-unswapped-rows,fp8-skinny-rows \
        --decode-batch 1,2,4,8,16,32,64 \
        --steps 64 --repeats 2 ;;
    vs-vllm-llama3)
      run_stage vs-vllm-llama3 vs_vllm "$RESULTS/vs_vllm_llama-3-8b.json" --models llama-3-8b ;;
    vs-vllm-llama2)
      run_stage vs-vllm-llama2 vs_vllm "$RESULTS/vs_vllm_llama-2-7b.json" --models llama-2-7b ;;
    vs-vllm)
      run_stage vs-vllm vs_vllm "$RESULTS/vs_vllm.json" ;;
    tests)
      run_stage tests $PY -m pytest -q -x tests/test_fused_kernels.py \
        tests/gpu/test_fused_model.py tests/gpu/test_cuda_graphs.py \
        tests/gpu/test_gpu_attention_backends.py ;;
    *)
      echo "gpu_suite: unknown stage $stage (decode offline-llama3 offline-llama2 programs" \
        "ablation json profile-llama3 profile-llama2 gemv fp8 fp8-batches vs-vllm vs-vllm-llama3" \
        "vs-vllm-llama2 tests)"
      failed+=("$stage") ;;
  esac
done

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_suite: failed stages: ${failed[*]}"
  exit 1
fi
echo "gpu_suite: all stages passed; JSON in $RESULTS/"
