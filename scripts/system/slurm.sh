#!/usr/bin/env bash
# Slurm (slurm-wlm: slurmctld + slurmd + client tools) and munge, for tests that run a real
# 2-node Slurm cluster on localhost (kiln_devtools.slurm_cluster). Idempotent: when every package is
# installed this returns at once, without touching apt; `apt-get update` runs only when a package
# is missing. Run as root (make system-deps).
set -euo pipefail

packages=(slurm-wlm munge)
missing=()
for pkg in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/system/slurm.sh: missing ${missing[*]}; run as root to install" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends keeps out mail servers and docs; Debian's packages enable daemons via
# systemd units, which tests never use (kiln_devtools.slurm_cluster starts its own under a tmp dir).
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "scripts/system/slurm.sh: installed ${missing[*]}"
