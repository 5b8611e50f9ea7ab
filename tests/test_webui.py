"""The built-in page (`GET /`, brisk/server/webui/index.html) in a real headless browser: Debian's chromium driven by
Playwright (make's set-up installs both). The page loads with no network beyond the server, a reply streams into
the chat with its timings under it, the engine view follows a load as it runs (requests, KV blocks held), and a
screenshot of it under load is kept (build/test-artifacts/). Behind the API key when one is set; --no-webui
turns it off."""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from engines import make_engine
from live_server import serve_engine

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "build" / "test-artifacts"
PAGE = Path(__file__).resolve().parent.parent / "brisk" / "server" / "webui" / "index.html"
# what a root, sandboxless, offline machine needs (the env's notes): no background connections, no GPU, no sandbox
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: `make test` (or `make serve`) installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(demo):
    with serve_engine(make_engine(demo, num_blocks=512), api_key="page-key") as live:
        yield live


def test_the_page_is_self_contained_and_small():
    text = PAGE.read_text(encoding="utf-8")
    assert len(text.encode()) < 300_000
    assert not re.search(r"""(src|href)\s*=\s*["']?https?://""", text)  # no CDN: works offline
    assert "import(" not in text and "<link" not in text


def test_the_page_needs_the_key_and_can_be_turned_off(server, demo):
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/").status_code == 401
        assert http.get("/?key=wrong").status_code == 401
        page = http.get("/?key=page-key")
        assert page.status_code == 200 and "<title>brisk</title>" in page.text
    with serve_engine(make_engine(demo), webui=False) as live, live.client() as http:
        assert http.get("/").status_code == 404


def test_a_reply_streams_into_the_chat_and_the_engine_view_follows_a_load(server, browser):
    page = browser.new_page(viewport={"width": 1280, "height": 820})
    failed_requests = []
    page.on("requestfailed", lambda r: failed_requests.append(r.url))
    page.goto(f"{server.url}/?key=page-key")
    page.wait_for_function("document.getElementById('model').textContent.includes('smollm2')", timeout=30_000)
    page.fill("#max_tokens", "24")
    page.fill("#prompt", "Say hello in one sentence.")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    reply.wait_for(state="attached")
    page.wait_for_function("document.querySelector('.msg.assistant:last-child')?.dataset.state === 'done'",
                           timeout=60_000)
    assert reply.locator(".content").inner_text().strip()
    timings = reply.locator(".timings").inner_text()
    assert "first token" in timings and "prefill" in timings and "context ok" in timings, timings

    # a load: 12 streams with a shared system prompt, while the page watches the engine
    stop = threading.Event()

    def load() -> None:
        system = "You are a helpful assistant who answers briefly. " * 8
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Count to thirty."}],
                "max_tokens": 96, "temperature": 0.8, "ignore_eos": True}
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer page-key"}, timeout=120) as http:
            threads = [threading.Thread(target=http.post, args=("/v1/chat/completions",), kwargs={"json": body})
                       for _ in range(12)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        stop.set()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        page.wait_for_function("Number(document.getElementById('running').textContent) >= 6 && "
                               "Number(document.getElementById('pool').dataset.used) > 8", timeout=60_000)
        assert page.locator("#requests tr").count() > 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "webui-under-load.png"), full_page=True)
    finally:
        loader.join()
    # after the load: the blocks are free again, some holding the shared prefix for a next request
    page.wait_for_function("Number(document.getElementById('pool').dataset.used) === 0 && "
                           "Number(document.getElementById('pool').dataset.cached) > 0", timeout=30_000)
    assert not [u for u in failed_requests if not u.startswith(server.url)]  # nothing reached off the machine
    page.close()


def test_the_api_docs_render_offline(demo, browser):
    """/docs: Swagger UI from the fastapi-swagger package, no CDN (FastAPI's own page was blank offline)."""
    with serve_engine(make_engine(demo)) as live:
        page = browser.new_page()
        outside = []
        page.on("request", lambda r: None if r.url.startswith(live.url) else outside.append(r.url))
        page.goto(f"{live.url}/docs")
        page.wait_for_selector("text=chat/completions", timeout=30_000)
        assert page.locator(".swagger-ui").count() == 1 and not outside, outside
        page.close()
