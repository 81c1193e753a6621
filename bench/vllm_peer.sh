#!/usr/bin/env bash
# Device side of ../shared/tools/vllm-peer/README.md: installs vLLM 0.26.0 and the wheels it needs
# into /tmp/vllm-site (for bench/vs_vllm.py and the gpu_suite.sh stages vs-vllm*).
#
# The tar's parts reach the machine one per device call (each call carries one
# .peer/vllm-peer.tar.part0K and copies it into /tmp/pc). Run this in the call that carries the
# last part and .peer/vllm-peer.tar.sha256: it copies the parts this call carries into /tmp/pc,
# joins them, checks the sha256 (a missing or broken part fails here), unpacks and installs with
# --no-deps. It does nothing when vLLM already imports from /tmp/vllm-site (a warm machine).
# The parts are 60 MiB; with the working tree (~4 MB) a call can pass the 64 MiB carry limit. Then
# re-split them here, any size, same names: `cd .peer && cat vllm-peer.tar.part0? > /tmp/v.tar &&
# rm vllm-peer.tar.part0? && split -b 54M -d -a 2 /tmp/v.tar vllm-peer.tar.part` (7 calls; the
# checksum is the whole tar's).
#   bash bench/vllm_peer.sh && bench/gpu_suite.sh vs-vllm-llama3
# Env: PYTHON (default python3), VLLM_PEER_PARTS (/tmp/pc), VLLM_SITE (/tmp/vllm-site),
#      VLLM_PEER_SHA256 (.peer/vllm-peer.tar.sha256).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PARTS=${VLLM_PEER_PARTS:-/tmp/pc}
SITE=${VLLM_SITE:-/tmp/vllm-site}
SUM=${VLLM_PEER_SHA256:-.peer/vllm-peer.tar.sha256}
export VLLM_NO_USAGE_STATS=1

check() { PYTHONPATH=$SITE $PY -c "import vllm; print('vllm', vllm.__version__, 'from', '$SITE')"; }

if check 2>/dev/null; then
  exit 0
fi
mkdir -p "$PARTS"
if compgen -G ".peer/vllm-peer.tar.part*" >/dev/null; then
  cp .peer/vllm-peer.tar.part* "$PARTS"/
fi
if [ ! -f "$SUM" ]; then
  echo "vllm_peer: no $SUM (carry it with the last part)" >&2
  exit 1
fi
echo "vllm_peer: parts in $PARTS:"
ls -l "$PARTS"/vllm-peer.tar.part*
cat "$PARTS"/vllm-peer.tar.part* > "$PARTS"/vllm-peer.tar
if ! sed "s# vllm-peer.tar# $PARTS/vllm-peer.tar#" "$SUM" | sha256sum -c -; then
  echo "vllm_peer: checksum mismatch: a part is missing or broken (see the list above)" >&2
  rm -f "$PARTS"/vllm-peer.tar
  exit 1
fi
tar -xf "$PARTS"/vllm-peer.tar -C "$PARTS"
rm -f "$PARTS"/vllm-peer.tar
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$PARTS"/wheels/*.whl
check
