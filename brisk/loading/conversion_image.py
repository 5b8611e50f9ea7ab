"""A GGUF's first start without waiting for the disk: the converted checkpoint is built in memory, byte for byte
the safetensors file a conversion writes (`gguf_convert.convert`), the server answers from it, and the file is
written into the conversion cache behind it while the engine is idle.

- The image is one private anonymous map in transparent huge pages (`MappedFile.anonymous`); the loader views
  its tensors as it views a mapped file's.
- `write_behind(busy)` starts the writer thread. It writes in chunks and waits while `busy()` (requests in
  flight) says so, up to `PATIENCE_S` in all, so a server under load from its first second still gets its cache.
  It runs at a lower CPU priority, and syncs the file while idle so the kernel's writeback does not land on a
  request later.
- Once the file is complete and renamed into place, the file is mapped over the image's addresses
  (`MappedFile.back_with`): the weights become the page cache's, shared with other processes, as on a warm
  start. A start killed mid-write leaves only a temporary folder whose lock died with it, removed by the next
  conversion (`gguf_convert.remove_stale_temp_dirs`); the cache appears whole or not at all.
- A process that exits while the write is unfinished finishes it first (`finish`, at exit): the next start
  finds the cache.

Measured against converting, writing and then serving (benchmarks/RESULTS.md, issue 65): on 2 cores the write
behind a request made it slower, so the writer yields to requests instead of racing them.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from brisk.loading import gguf_convert
from brisk.loading.safetensors_io import MappedFile, parse_header, tensors_of

log = logging.getLogger("brisk.loading")

CHUNK_BYTES = 64 << 20  # one write between two looks at the engine
SYNC_EVERY_BYTES = 512 << 20  # written back while idle, not left to the kernel's flusher mid-request
PATIENCE_S = 30.0  # the longest the writer waits on a busy engine, in all; then it writes regardless
QUIET_S = 0.5  # idle this long before a write resumes (a burst's next request usually comes sooner)
POLL_S = 0.05


@contextlib.contextmanager
def _heap_reused():
    """glibc's malloc keeping freed large blocks for the next tensor instead of unmapping each and faulting
    fresh pages in for the next (a conversion makes and frees hundreds of arrays of 10-100 MB): the
    7B Q4_K_M's arrays were made in 1.5-1.6 s against 2.5-2.8 s. After it, the thresholds are set where glibc's
    own adaptive ones end (32 MiB, 64 MiB) and the freed heap is given back. Nothing changes off glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, 1 << 30)
    mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        mallopt(_M_TRIM_THRESHOLD, 64 << 20)
        trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


class _ImageWriter:
    """`write` of the streaming conversion, into the image: a cursor copying bytes (numpy's copy drops the GIL)."""

    def __init__(self, mapped: MappedFile):
        import numpy as np

        self.bytes = np.frombuffer(mapped.mm, dtype=np.uint8)
        self.at = 0

    def write(self, data) -> None:
        import numpy as np

        view = np.frombuffer(data, dtype=np.uint8) if not hasattr(data, "view") else data.reshape(-1).view(np.uint8)
        self.bytes[self.at:self.at + view.size] = view
        self.at += view.size


class ConvertedImage:
    """A first start's converted checkpoint in memory, and the cache folder it will be written to."""

    def __init__(self, gguf_path: Path, out_dir: Path, quantization: str = "auto"):
        config, fast_tokenizer, tok_config, plan, self.timings = gguf_convert.prepare(gguf_path, out_dir, quantization)
        self.out_dir = out_dir
        self.folder, self._lock = gguf_convert.temp_folder(out_dir)  # the small files now, the weights later
        self.published = False
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._busy: Callable[[], bool] = lambda: False
        self._hurry = threading.Event()  # exit: write without waiting on the engine
        try:
            gguf_convert.write_small_files(self.folder, gguf_path, config, fast_tokenizer, tok_config, quantization)
            t0 = time.perf_counter()
            head, size = gguf_convert.header_blob(plan, gguf_convert.SAFETENSORS_METADATA)
            self.mapped = MappedFile.anonymous(len(head) + size)
            sink = _ImageWriter(self.mapped)
            sink.write(head)
            with _heap_reused():
                gguf_convert.stream_tensors(sink, plan, gguf_convert.conversion_label(out_dir), overlap=False)
            self.timings["convert_in_memory"] = (time.perf_counter() - t0) * 1e3
        except BaseException:
            self._discard()
            raise
        atexit.register(self.finish)

    @property
    def nbytes(self) -> int:
        return len(self.mapped.mm)

    def tensors(self) -> dict:
        """The checkpoint's tensors as zero-copy views of the image (what a mapped cache file gives)."""
        import io

        head = io.BytesIO(self.mapped.mm[:8 + int.from_bytes(self.mapped.mm[:8], "little")])
        header, data_start = parse_header(head, self.nbytes, self.out_dir / "model.safetensors")
        return tensors_of(self.mapped, header, data_start)

    def write_behind(self, busy: Callable[[], bool] = lambda: False) -> None:
        """Start writing the cache on a thread of its own, yielding to the engine while `busy()`."""
        if self._thread is not None:
            return
        self._busy = busy
        self._thread = threading.Thread(target=self._write, name="brisk-conversion-cache", daemon=True)
        self._thread.start()

    def finish(self, timeout: float | None = None) -> bool:
        """Write what is left now, without waiting on the engine (at exit); True once the cache is in place."""
        self._hurry.set()
        if self._thread is None and not self.published and self.error is None:
            log.info("writing the conversion cache %s before exit (%.1f GB)", self.out_dir.name, self.nbytes / 1e9)
            self.write_behind()
        return self.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the writer; True once the cache is in place."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.published

    def _yield_to_engine(self, waited: float) -> float:
        """Sleep while the engine is busy (and until it was idle QUIET_S), within the patience left."""
        quiet_since = None
        while not self._hurry.is_set() and waited < PATIENCE_S:
            now = time.monotonic()
            if self._busy():
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= QUIET_S:
                break
            time.sleep(POLL_S)
            waited += time.monotonic() - now
        return waited

    def _write(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (OSError, AttributeError):
            pass
        path = self.folder / "model.safetensors"
        try:
            t0, waited = time.monotonic(), 0.0
            view = memoryview(self.mapped.mm)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                unsynced = 0
                for at in range(0, self.nbytes, CHUNK_BYTES):
                    waited = self._yield_to_engine(waited)
                    chunk = view[at:at + CHUNK_BYTES]
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
                    unsynced += CHUNK_BYTES
                    if unsynced >= SYNC_EVERY_BYTES:
                        os.fdatasync(fd)
                        unsynced = 0
                os.fsync(fd)
            finally:
                os.close(fd)
                view.release()
            self.published = gguf_convert.publish(self.folder, self.out_dir)
            if self.published:  # the weights become the cache file's pages (a concurrent winner's are its own)
                self.mapped.back_with(self.out_dir / "model.safetensors")
            log.info("conversion cache written: %s (%.1f GB in %.1f s, %.1f s of it waiting on requests)",
                     self.out_dir, self.nbytes / 1e9, time.monotonic() - t0, waited)
        except BaseException as e:  # noqa: BLE001 - a failed cache write costs the next start, never this one
            self.error = e
            log.warning("the conversion cache %s was not written (%s); the next start converts the file again",
                        self.out_dir, e)
            self._discard()
        finally:
            self._release_lock()

    def _discard(self) -> None:
        if not self.published:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
