"""scripts/torch_index.py: `make` and check_install.sh take PyTorch's CPU wheel index on a machine
without an NVIDIA GPU when that index answers (a local HTTP server stands in for it here)."""

import importlib.util
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "torch_index.py"


@pytest.fixture
def script():
    spec = importlib.util.spec_from_file_location("torch_index", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def index():
    class Index(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
            self.end_headers()
            self.wfile.write(b"<a href='torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl'>torch</a>")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()


def run(script, capsys, monkeypatch, gpu: bool, url: str) -> str:
    monkeypatch.delenv("BRISK_TORCH_INDEX", raising=False)
    monkeypatch.setattr(script, "has_nvidia_gpu", lambda: gpu)
    monkeypatch.setattr(script, "CPU_INDEX", url)
    assert script.main() == 0
    return capsys.readouterr().out.strip()


def test_no_gpu_and_a_reachable_index_takes_the_cpu_build(script, index, capsys, monkeypatch):
    assert run(script, capsys, monkeypatch, False, index) == f"--extra-index-url {index}"


def test_a_gpu_or_an_unreachable_index_adds_nothing(script, index, capsys, monkeypatch):
    assert run(script, capsys, monkeypatch, True, index) == ""
    assert run(script, capsys, monkeypatch, False, index.replace("/whl/cpu", "/nowhere")) == ""


def test_the_environment_overrides_it(script, capsys, monkeypatch):
    monkeypatch.setenv("BRISK_TORCH_INDEX", "https://mirror.example/whl/cpu")
    assert script.main() == 0 and capsys.readouterr().out.strip() == "--extra-index-url https://mirror.example/whl/cpu"
    monkeypatch.setenv("BRISK_TORCH_INDEX", "none")
    assert script.main() == 0 and capsys.readouterr().out.strip() == ""
