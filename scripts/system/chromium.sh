#!/usr/bin/env bash
# Headless Chromium + its WebDriver (Debian packages `chromium`, `chromium-driver`) for the browser
# test (tests/e2e/test_browser.py, driven by selenium). Idempotent: when both packages are installed
# this returns at once without touching apt; `apt-get update` runs only when one is missing.
# Run as root (make system-deps). Debian's build is used because nothing may download a browser
# build at run time here (Selenium Manager / playwright installers would try to).
set -euo pipefail

packages=(chromium chromium-driver)
missing=()
for pkg in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    [ "$status" = "install ok installed" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/system/chromium.sh: missing ${missing[*]}; run as root to install" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends keeps out desktop integration (upower, xdg-utils, …) a headless run never uses.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
command -v chromium >/dev/null && command -v chromedriver >/dev/null
echo "scripts/system/chromium.sh: installed ${missing[*]}"
