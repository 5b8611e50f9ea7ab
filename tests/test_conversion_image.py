"""A GGUF's first start from its conversion built in memory (brisk/loading/conversion_image.py): the image is the
file `gguf_convert.convert` writes, byte for byte; its cache is written behind the server while the engine idles,
lands whole (a write killed midway leaves none), and then backs the weights' memory; a served first start answers
as a warm start does."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from brisk.loading import conversion_image, gguf_convert
from brisk.loading.conversion_image import ConvertedImage
from brisk.loading.gguf_random import Shape, write_random_gguf
from brisk.loading.safetensors_io import MappedFile

SHAPE = Shape(hidden=256, layers=1, ffn=512, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return write_random_gguf(tmp_path_factory.mktemp("gguf") / "Q4_K_M.gguf", SHAPE, "Q4_K_M", None,
                             small_vocab=132)


def _files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if not f.name.startswith(".")}


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q8_0", "Q4_1", "Q2_K_mix"])
def test_the_image_and_its_cache_are_what_a_conversion_writes(tmp_path, mix):
    path = write_random_gguf(tmp_path / f"{mix}.gguf", SHAPE, mix, None, small_vocab=132)
    gguf_convert.convert(path, tmp_path / "written" / "m")
    expected = _files(tmp_path / "written" / "m")
    image = ConvertedImage(path, tmp_path / "behind" / "m")
    assert bytes(image.mapped.mm) == expected["model.safetensors"]
    assert not (tmp_path / "behind" / "m").exists()  # nothing in place before it is written
    image.write_behind()
    assert image.wait(60) and image.error is None
    assert _files(tmp_path / "behind" / "m") == expected
    assert [p.name for p in (tmp_path / "behind").iterdir()] == ["m"]  # no temporary folder left


def test_tensors_read_the_image_then_the_cache_file(tmp_path, small_gguf):
    image = ConvertedImage(small_gguf, tmp_path / "m")
    tensors = image.tensors()
    name = "model.norm.weight"
    before = {n: t.clone() for n, t in tensors.items()}
    assert image.mapped.path is None
    image.write_behind()
    assert image.wait(60)
    assert image.mapped.path == tmp_path / "m" / "model.safetensors"
    assert all(torch.equal(t, before[n]) for n, t in tensors.items())
    # the file now backs the tensors' memory: a byte changed in it is seen through them
    offset = tensors[name].data_ptr() - image.mapped.base
    fd = os.open(image.mapped.path, os.O_WRONLY)
    try:
        os.pwrite(fd, (0x7F800000).to_bytes(4, "little"), offset)  # +inf in float32
    finally:
        os.close(fd)
    assert tensors[name][0].item() == float("inf")


def test_release_keeps_an_anonymous_maps_pages_until_a_file_backs_them(tmp_path):
    size = 4 * 4096 * 4
    data = torch.arange(size // 4, dtype=torch.float32)
    path = tmp_path / "image.bin"
    path.write_bytes(data.numpy().tobytes())
    mapped = MappedFile.anonymous(size)
    t = mapped.tensor(0, torch.float32, [size // 4])
    t.copy_(data)
    assert mapped.release(t)
    assert torch.equal(t, data)  # MADV_DONTNEED on anonymous memory would have zeroed it
    mapped.back_with(path)
    assert torch.equal(t, data)  # dropped, then read again from the file
    assert mapped.path == path
    with pytest.raises(ValueError, match="bytes"):
        MappedFile.anonymous(size * 2).back_with(path)


def test_faulting_the_image_in_lets_other_threads_run():
    """The server's event loop answers /ready while a first start's image is faulted in: the populate must not
    hold the GIL (Python's mmap.madvise does; it stalled /ready for 7 s on a 4.6 GB image)."""
    gaps, done, took = [], threading.Event(), []

    def populate():
        t0 = time.perf_counter()
        MappedFile.anonymous(2 << 30)
        took.append(time.perf_counter() - t0)
        done.set()

    thread = threading.Thread(target=populate)
    last = time.perf_counter()
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    if took[0] < 0.1:
        pytest.skip(f"2 GiB faulted in within {took[0] * 1e3:.0f} ms: too fast here to tell a held GIL from a free one")
    assert max(gaps) < took[0] / 2, (max(gaps), took[0])


def test_the_writer_waits_while_the_engine_is_busy(tmp_path, small_gguf, monkeypatch):
    monkeypatch.setattr(conversion_image, "QUIET_S", 0.05)
    busy = threading.Event()
    busy.set()
    image = ConvertedImage(small_gguf, tmp_path / "m")
    image.write_behind(busy=busy.is_set)
    time.sleep(0.5)
    written = image.folder / "model.safetensors"
    assert not written.exists() or written.stat().st_size == 0
    assert not image.published
    busy.clear()
    assert image.wait(60) and (tmp_path / "m" / "model.safetensors").stat().st_size == image.nbytes


def test_patience_bounds_the_wait_on_a_busy_engine(tmp_path, small_gguf, monkeypatch):
    monkeypatch.setattr(conversion_image, "PATIENCE_S", 0.3)
    image = ConvertedImage(small_gguf, tmp_path / "m")
    image.write_behind(busy=lambda: True)
    assert image.wait(60)


def test_a_full_disk_costs_the_cache_never_the_served_weights(tmp_path, small_gguf, monkeypatch, caplog):
    """The cache write fails (ENOSPC): one warning, no cache and no temporary folder left, and the weights the
    server answers from stay what they were (the image is not backed by a half-written file)."""
    import errno

    image = ConvertedImage(small_gguf, tmp_path / "m")
    tensors = image.tensors()
    before = {name: t.clone() for name, t in tensors.items()}
    temp = image.folder

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(conversion_image.os, "write", full_disk)
    with caplog.at_level("WARNING", logger="brisk.loading"):
        image.write_behind()
        assert not image.wait(60)
    assert isinstance(image.error, OSError) and image.error.errno == errno.ENOSPC
    assert "was not written" in caplog.text and "converts the file again" in caplog.text
    assert not (tmp_path / "m").exists() and not temp.exists()
    assert image.mapped.path is None
    assert all(torch.equal(tensors[name], before[name]) for name in before)


_KILLED_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from brisk.loading import conversion_image

conversion_image.CHUNK_BYTES = 4096
calls = []
def dying_write(fd, data):
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.write(fd, data)

conversion_image.os = type("os", (), {**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")},
                                       "write": staticmethod(dying_write)})
image = conversion_image.ConvertedImage(Path(sys.argv[1]), Path(sys.argv[2]))
image.write_behind()
image.wait()
"""

_EXITS_BEFORE_WRITING = """
import sys
from pathlib import Path
from brisk.loading.conversion_image import ConvertedImage

image = ConvertedImage(Path(sys.argv[1]), Path(sys.argv[2]))
print(image.published, flush=True)
"""


def test_a_write_killed_midway_leaves_no_cache(tmp_path, small_gguf):
    out = tmp_path / "converted" / "m"
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_WRITE, str(small_gguf), str(out)],
                            capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert not out.exists()
    stale = [p for p in out.parent.iterdir() if gguf_convert.TEMP_MARK in p.name]
    assert len(stale) == 1 and 0 < (stale[0] / "model.safetensors").stat().st_size
    image = ConvertedImage(small_gguf, out)  # the next first start sweeps it away
    assert not stale[0].exists()
    image.write_behind()
    assert image.wait(60)


def test_a_process_that_exits_first_finishes_the_cache(tmp_path, small_gguf):
    out = tmp_path / "converted" / "m"
    done = subprocess.run([sys.executable, "-c", _EXITS_BEFORE_WRITING, str(small_gguf), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
    gguf_convert.convert(small_gguf, tmp_path / "written")
    assert _files(out) == _files(tmp_path / "written")


def test_a_served_first_start_answers_as_a_warm_start(tmp_path, demo_gguf_path):
    """`brisk serve` on an empty cache: the load report says its conversion ran in memory, the cache appears once
    the server idles, and a second start (a cache hit) gives the same greedy tokens."""
    import httpx

    sys.path.insert(0, str(Path(__file__).parent))
    from test_serve_process import free_port

    env = {**os.environ, "BRISK_CACHE": str(tmp_path / "cache")}
    body = {"model": "demo", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
            "temperature": 0}
    answers, logs = [], []
    for start in range(2):
        port = free_port()
        log = tmp_path / f"serve-{start}.log"
        proc = subprocess.Popen([sys.executable, "-m", "brisk", "serve", str(demo_gguf_path), "--port", str(port),
                                 "--served-model-name", "demo"], env=env, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                try:
                    if httpx.get(url + "/ready", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["message"]["content"])
            converted = tmp_path / "cache" / "converted"
            while start == 0 and not any(converted.glob("*/model.safetensors")):  # written once the server idles
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(60)
        logs.append(log.read_text())
    assert "convert_in_memory" in logs[0] and "conversion cache miss" in logs[0]
    assert "conversion cache written" in logs[0]
    assert "conversion cache hit" in logs[1] and "convert_in_memory" not in logs[1]
    assert answers[0] == answers[1] and answers[0]
