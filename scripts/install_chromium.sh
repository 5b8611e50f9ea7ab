#!/usr/bin/env bash
# Debian's chromium for the web page's browser test (tests/test_webui.py drives it with Playwright; a test tool's
# own browser download is not possible here). Nothing to do where chromium is already installed.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    run=()
elif command -v sudo >/dev/null 2>&1; then
    run=(sudo)
else
    echo "chromium is missing and this user cannot install it: run 'apt-get install chromium' as root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${run[@]}" apt-get update -qq
"${run[@]}" apt-get install -y -qq --no-install-recommends chromium >/dev/null
