#!/usr/bin/env bash
# Put promtool (Prometheus's rule checker, used by tests/test_alert_rules.py) at .venv/bin/promtool.
# Only the binary: Debian's `prometheus` package is downloaded and unpacked, never installed, so no
# Prometheus server, service or dependency lands on the machine. Idempotent; quick when already there.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.venv/bin/promtool
if [ -x "$dest" ] && "$dest" --version >/dev/null 2>&1; then exit 0; fi
if command -v promtool >/dev/null 2>&1; then ln -sf "$(command -v promtool)" "$dest"; exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: promtool not found and no apt-get: install Prometheus's promtool to run tests/test_alert_rules.py" >&2
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
install -m 0755 "$tmp/root/usr/bin/promtool" "$dest"
echo "setup: promtool: $("$dest" --version 2>&1 | head -1)"
