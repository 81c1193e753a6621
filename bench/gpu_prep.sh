#!/usr/bin/env bash
# Here, before the first device call of a fresh checkout: what the GPU machine lacks, into the
# git-ignored .gpu/ that device calls carry (~21 MB). The machine has no network and Python 3.12;
# bench/gpu_suite.sh and the session scripts install from these folders.
#   .gpu/deps       lmnb's pure dependencies the GPU image lacks (greenlet), 3.12 wheels
#   .gpu/whl        FlashInfer (0.6.14, the vLLM peer's) and what it imports, 3.12 wheels
#   .gpu/tokenizer  the embedded SmolLM2's tokenizer and config files (bench/fp8.py
#                   --tokenizer, LMNB_TOKENIZER_DIR for tests/gpu), from `make venv`'s model
#   bash bench/gpu_prep.sh             # then carry [".gpu/deps", ".gpu/whl", ".gpu/tokenizer"]
# Env: PYTHON (default .venv/bin/python, for the tokenizer; run `make venv` first). The Llama-3
# tokenizer is bench/fetch_tokenizers.sh's; vLLM is bench/vllm_peer.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
download() {  # FOLDER SPEC...: Linux x86_64 CPython 3.12 wheels, no dependencies
  local folder=$1; shift
  mkdir -p "$folder"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$folder" "$@"
}
download .gpu/deps "greenlet>=3"
download .gpu/whl flashinfer-python==0.6.14 apache-tvm-ffi==0.1.10 einops tabulate ninja
model_dir=$($PY -c "from lmnb.runtime.models.loader import resolve_model_dir; print(resolve_model_dir(None))" | tail -1)
mkdir -p .gpu/tokenizer
cp "$model_dir"/*.json "$model_dir"/*.jinja .gpu/tokenizer/ 2>/dev/null || cp "$model_dir"/*.json .gpu/tokenizer/
ls .gpu/deps .gpu/whl .gpu/tokenizer
du -sh .gpu/deps .gpu/whl .gpu/tokenizer
