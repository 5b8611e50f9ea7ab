"""`brisk serve` as a real process: the socket opens before the model is ready, and
SIGTERM drains (short requests finish, long ones end with an error event, the process exits)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

CHAT = [{"role": "user", "content": "Tell me a long story about the sea."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process(demo):  # `demo` has filled the conversion cache this process's env points at
    port = free_port()
    # --shutdown-timeout 6: the 24-token stream, half done at SIGTERM, finishes inside the drain; the
    # 1900-token one cannot
    cmd = [sys.executable, "-m", "brisk", "serve", "--port", str(port), "--shutdown-timeout", "6",
           "--max-model-len", "2048", "--kv-cache-memory", "256MiB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    yield proc, f"http://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def wait_for(url: str, path: str, want, timeout_s: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + path, timeout=5)
            if want(r):
                return r
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{path} never satisfied the condition within {timeout_s} s")


def test_socket_answers_before_ready_then_sigterm_drains(serve_process):
    proc, url = serve_process
    first = wait_for(url, "/ready", lambda r: True)  # the first answer the socket gives
    ready = wait_for(url, "/ready", lambda r: r.status_code == 200)
    assert first.status_code in (200, 503)
    if first.status_code == 503:
        assert first.json()["status"] == "loading" and "phase" in first.json()
    assert ready.json()["model"] == "smollm2-135m-instruct"

    results: dict[str, list] = {"short": [], "long": []}
    short_half_done = threading.Event()

    def stream(name: str, max_tokens: int):
        body = {"messages": CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    results[name].append(line[6:])
                    if name == "short" and len(results[name]) >= 12:
                        short_half_done.set()

    threads = [threading.Thread(target=stream, args=("short", 24)), threading.Thread(target=stream, args=("long", 1900))]
    for t in threads:
        t.start()
    wait_for(url, "/metrics", lambda r: "brisk:num_requests_running 2.0" in r.text, timeout_s=30)
    # SIGTERM once the short stream is half done: its last ~12 tokens fit the 6 s drain however slow the
    # host is, the long stream's ~1,890 do not however fast it is
    assert short_half_done.wait(60), results
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a stream hung through shutdown"
    assert proc.wait(timeout=60) == 0
    short, long_ = results["short"], results["long"]
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    assert long_[-1] == "[DONE]"
    error = json.loads(long_[-2])["error"]
    assert error["code"] == "shutting_down" and "6 s" in error["message"]
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    log = proc.stdout.read()
    # the log ends with the drain's outcome: the short stream finished, the long one was cut
    last = log.rstrip().splitlines()[-1]
    assert last.endswith("stopped (exit 0): 2 requests were in flight at shutdown, 1 finished, 1 ended by the 6 s "
                         "drain timeout"), log[-2000:]
    paths = [line for line in log.splitlines() if "compute paths on cpu:" in line]
    assert len(paths) == 1, log[-3000:]  # the one place that picks each path says it once (brisk/kernels/paths.py)


def test_bad_model_fails_fast_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "brisk", "serve", str(tmp_path / "nope.gguf"), "--port",
                           str(free_port())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "Traceback" not in proc.stderr


def test_the_demo_answers_tools_as_make_serve_starts_it(demo):
    """`make serve` is `brisk serve` on the demo: its catalog template renders tools, so the README's tool-calling
    example works on the first try (and a plain chat renders exactly as the model's own template does)."""
    import copy

    from brisk.server.preflight import chat_template

    shipped = copy.copy(demo.tokenizer)
    shipped.set_chat_template(chat_template("smollm2_tools"))
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        assert shipped.encode_chat(messages) == demo.tokenizer.encode_chat(messages)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "brisk", "serve", "--port", str(port), "--max-model-len", "2048",
                             "--kv-cache-memory", "256MiB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url, "/ready", lambda r: r.status_code == 200)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools,
            "tool_choice": "required", "temperature": 0, "max_tokens": 60})
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
