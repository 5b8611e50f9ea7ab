"""Grammar compilation tried first in a separate process, so that a grammar that crashes the
grammar library costs its request a 400, never the server.

llguidance is native code that recurses while it converts a schema and builds a matcher; on
deep enough input it overflows its stack and the process dies (a segfault: no Python exception
to catch). `limits` refuses the known shapes first; this sandbox covers the rest. A worker
process (`python -m brisk.structured.sandbox`) holds the tokenizer and, for each new grammar,
converts it, builds its matcher and computes its first mask on a thread with a small stack
(CHECK_STACK_BYTES). Only a grammar that passed there is built in the server, on a thread with
a stack 16 times larger (BUILD_STACK_BYTES): the same deterministic code on the same input
cannot overflow it. A worker that dies or runs past COMPILE_TIMEOUT_S is killed, the request
gets a 400 naming its field, and the next grammar starts a new worker.

Messages are length-prefixed JSON on the worker's stdin/stdout; the worker exits when its stdin
closes, so it never outlives the server.
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from brisk.structured.sources import GrammarError, grammar_source, short
from brisk.structured.spec import GrammarSpec

log = logging.getLogger("brisk.structured")

CHECK_STACK_BYTES = 4 << 20
BUILD_STACK_BYTES = 64 << 20
COMPILE_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0  # the worker wraps the tokenizer once (~0.5 s here; longer on a loaded host)
_HEADER = struct.Struct("<I")


class SandboxError(GrammarError):
    """The worker died or timed out on this grammar."""


class SandboxClosed(RuntimeError):
    """A grammar was asked for after the sandbox was closed."""


def run_with_stack(fn: Callable[[], Any], stack_bytes: int, name: str) -> Any:
    """fn() on a new thread with a stack of `stack_bytes`; returns its result or raises its error."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = e

    with _STACK_SIZE_LOCK:  # threading.stack_size is process-wide: set it only around this start
        old = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
        finally:
            threading.stack_size(old)
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


_STACK_SIZE_LOCK = threading.Lock()


class CompileSandbox:
    """The server's side: one worker at a time, one grammar at a time (new grammars only: the
    compiler's cache answers repeats without coming here)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self._hello = {"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": list(eos_token_ids)}
        self.timeout_s = timeout_s
        self.workers_started = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self.closed = False  # after close(): no worker is started ahead of need

    def check(self, spec: GrammarSpec) -> str:
        """The grammar text of `spec`, once the worker built its matcher and first mask without dying;
        GrammarError (400) otherwise."""
        message = {"kind": spec.kind, "value": spec.value, "field": spec.field, "ws": spec.whitespace_pattern}
        with self._lock:
            proc = self._running_worker()
            try:
                _send(proc, message)
                reply = _receive(proc, time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._stop_worker()
                log.warning("grammar compile sandbox: %s ran past %g s; worker killed", spec.field, self.timeout_s)
                raise SandboxError(spec.field, f"took longer than {self.timeout_s:g} s to compile; simplify it "
                                               "(fewer alternatives, shorter repetitions)") from None
            except (EOFError, OSError):
                code = self._stop_worker()
                log.warning("grammar compile sandbox: the grammar library died on %s (exit %s); worker restarted "
                            "for the next grammar", spec.field, code)
                raise SandboxError(spec.field, "is too deep or too large for the grammar compiler (it crashed "
                                               "building it); simplify it") from None
        if "error" in reply:
            raise GrammarError(spec.field, reply["error"])
        return reply["grammar"]

    def start(self) -> None:
        """Start the worker now (the server does it at start-up, off the request path)."""
        with self._lock:
            self._running_worker()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._stop_worker()

    def _running_worker(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self.closed:
            raise SandboxClosed("the grammar compile sandbox is closed (the server is stopping)")
        self._stop_worker()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "brisk.structured.sandbox"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        self._finalizer = weakref.finalize(self, _kill, proc)
        try:
            _send(proc, self._hello)
            ready = _receive(proc, time.monotonic() + START_TIMEOUT_S)
        except (EOFError, OSError, TimeoutError) as e:
            _kill(proc)
            raise RuntimeError(f"the grammar compile worker did not start ({type(e).__name__})") from None
        if "error" in ready:
            _kill(proc)
            raise RuntimeError(f"the grammar compile worker did not start: {ready['error']}")
        self._proc = proc
        self.workers_started += 1
        return proc

    def _stop_worker(self) -> int | None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return _kill(proc) if proc is not None else None


def _kill(proc: subprocess.Popen) -> int | None:
    """Close the worker's pipes and make sure it is gone; its exit code (negative: the signal)."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass
    try:
        return proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _send(proc: subprocess.Popen, message: dict) -> None:
    data = json.dumps(message).encode()
    proc.stdin.write(_HEADER.pack(len(data)) + data)
    proc.stdin.flush()


def _receive(proc: subprocess.Popen, deadline: float) -> dict:
    header = _read_exactly(proc.stdout.fileno(), _HEADER.size, deadline)
    return json.loads(_read_exactly(proc.stdout.fileno(), _HEADER.unpack(header)[0], deadline))


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    chunks, remaining = [], size
    while remaining:
        timeout = deadline - time.monotonic()
        if timeout <= 0 or not select.select([fd], [], [], timeout)[0]:
            raise TimeoutError
        chunk = os.read(fd, remaining)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


# -- the worker process ------------------------------------------------------------------
def _check(tokenizer: Any, vocab_size: int, eos: list[int], message: dict) -> dict:
    import llguidance

    spec = GrammarSpec(message["kind"], message["value"], message["field"], message["ws"])
    try:
        source = grammar_source(spec)
    except GrammarError as e:
        return {"error": e.message}
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
    if matcher.is_error():
        return {"error": f"cannot be compiled: {short(matcher.get_error())}"}
    mask = matcher.compute_bitmask()
    if not matcher.is_accepting() and not _allows_a_text_token(mask, vocab_size, eos):
        return {"error": "matches no text this model can write (an empty language, a rule or $ref that only "
                         "leads back to itself, or characters its vocabulary has no tokens for); fix the grammar"}
    return {"grammar": source}


def _allows_a_text_token(mask: bytes, vocab_size: int, eos: list[int]) -> bool:
    bits = bytearray(mask)
    for token in eos:  # the end-of-sequence tokens do not count: they end an empty reply
        if token < vocab_size:
            bits[token // 8] &= ~(1 << (token % 8)) & 0xFF
    return any(bits)


def _worker_main() -> None:
    # fd 1 carries replies: point it at stderr so that nothing the library prints can corrupt them
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer

    def receive() -> dict | None:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None
        return json.loads(stdin.read(_HEADER.unpack(header)[0]))

    def reply(message: dict) -> None:
        data = json.dumps(message).encode()
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()

    hello = receive()
    if hello is None:
        return
    from tokenizers import Tokenizer

    from brisk.structured.vocabulary import llg_tokenizer

    try:
        tokenizer = llg_tokenizer(Tokenizer.from_str(hello["tokenizer"]), hello["vocab_size"], hello["eos"])
    except Exception as e:  # noqa: BLE001 - reported to the server, which names it
        reply({"error": short(str(e))})
        return
    reply({"ready": True})
    while (message := receive()) is not None:
        try:
            result = run_with_stack(lambda: _check(tokenizer, hello["vocab_size"], hello["eos"], message),
                                    CHECK_STACK_BYTES, "brisk-grammar-check")
        except Exception as e:  # noqa: BLE001 - the library refused the grammar in its own way
            result = {"error": f"cannot be compiled: {short(str(e))}"}
        reply(result)


if __name__ == "__main__":
    _worker_main()
