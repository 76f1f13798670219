#!/usr/bin/env bash
# Put promtool (Prometheus's rule checker, tests/test_alert_rules.py) and the prometheus server binary (started on
# loopback by tests/test_prometheus_e2e.py, never as a service) in .venv/bin. Only the two binaries: Debian's
# `prometheus` package is downloaded and unpacked, never installed, so no service, user or dependency lands on
# the machine. Idempotent; quick when both are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
have() { [ -x ".venv/bin/$1" ] && ".venv/bin/$1" --version >/dev/null 2>&1; }
if have promtool && have prometheus; then exit 0; fi
for bin in promtool prometheus; do
  if ! have "$bin" && command -v "$bin" >/dev/null 2>&1; then ln -sf "$(command -v "$bin")" ".venv/bin/$bin"; fi
done
if have promtool && have prometheus; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: promtool/prometheus not found and no apt-get: install Prometheus (promtool and the server binary)" \
       "to run tests/test_alert_rules.py and tests/test_prometheus_e2e.py" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A fresh machine has no package lists yet: update them once (root only), then download.
if ! (cd "$tmp" && apt-get download -q prometheus >/dev/null 2>&1); then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null; fi
  (cd "$tmp" && apt-get download -q prometheus >/dev/null)
fi
dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/root"
for bin in promtool prometheus; do
  have "$bin" || install -m 0755 "$tmp/root/usr/bin/$bin" ".venv/bin/$bin"
done
echo "setup: $(.venv/bin/prometheus --version 2>&1 | head -1)"
