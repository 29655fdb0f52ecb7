#!/usr/bin/env bash
# Prometheus + promtool (Debian package `prometheus`) for the alert-rule tests
# (tests/integration/test_prometheus.py). Idempotent: returns at once when both binaries exist;
# `apt-get update` only when the package is missing. Run as root (`make system-deps`).
# The package's service is not started: tests run their own `prometheus` on a free port.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "prometheus.sh: prometheus/promtool missing and not root; run: sudo bash $0" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: the recommends pull node-exporter and its collectors, which we do not run.
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# Debian's postinst may start the packaged service where an init system runs; it would hold :9090.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
command -v promtool >/dev/null
