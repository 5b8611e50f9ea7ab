"""The synchronous engine core: add_request / abort / step.

`step()` is schedule -> run -> postprocess. Postprocessing appends sampled tokens,
detokenizes incrementally, applies stop tokens, stop strings (held back while a
partial match is possible), EOS and max_tokens, and frees finished requests' blocks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from brisk.config import CacheConfig, host_available_memory
from brisk.engine.kv_cache.disk_tier import HEADER_BYTES, DiskTier, fingerprint
from brisk.engine.kv_cache.host_tier import HostTier
from brisk.engine.kv_cache.manager import KVCacheManager, PendingSpill
from brisk.loading.memory_plan import available_memory
from brisk.engine.model_runner import ModelRunner
from brisk.engine.outputs import RequestOutput, find_stop, stop_window
from brisk.engine.request import Request, RequestStatus
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import Scheduler, SchedulerConfig
from brisk.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from brisk.engine.spec_decode.drafter import NgramDrafter
from brisk.engine.stats import EngineStats, SpecStats
from brisk.errors import BriskError, ParamError
from brisk.kv_dtype import resolve as resolve_kv_dtype
from brisk.loading.loader import LoadedModel
from brisk.text import held_back_length
from brisk.structured.tools import ToolCallParser

log = logging.getLogger("brisk.engine")


REPEATED_TOOL_CALL = "repeated_tool_call"  # the stop_reason of a reply ended at a repeated call
DISK_READ_WAIT_S = 0.01  # an idle engine waits this long at most for a disk read before it looks again


class RequestError(ParamError, BriskError):
    """A request the engine cannot take (too long, bad token ids); names the field."""


class GrammarRejectedError(RuntimeError):
    """A sampled token the request's grammar does not accept: the request cannot be continued."""

    reason = "grammar_rejected"


class GrammarUnsatisfiableError(GrammarRejectedError):
    """No token of the vocabulary continues the request's grammar (it needs text the vocabulary cannot
    write): the client's grammar cannot be met with this model."""

    reason = "grammar_unsatisfiable"

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


@dataclass
class _Pending:
    """Text decoded but not yet released (it may be the start of a stop string)."""

    text: str = ""


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None, seed: int = 0,
                 speculative: SpeculativeConfig | None = None, draft: LoadedModel | None = None,
                 batch_invariant: bool | None = None):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.cache_config = cache or CacheConfig()
        self.scheduler_config = scheduler or SchedulerConfig(max_model_len=loaded.max_model_len)
        if self.scheduler_config.max_model_len > loaded.max_model_len:
            raise BriskError(f"max_model_len {self.scheduler_config.max_model_len} exceeds the model's "
                             f"{loaded.max_model_len}")
        self.kv_dtype = resolve_kv_dtype(self.cache_config.kv_cache_dtype, str(loaded.dtype).removeprefix("torch."),
                                         str(loaded.device))
        bytes_per_token = loaded.config.kv_bytes_per_token(self.kv_dtype)
        if draft is not None and speculative is not None and speculative.method == "draft_model":
            # the draft keeps its own K/V, in the same dtype, for every slot of the pool: the budget holds both
            bytes_per_token += draft.config.kv_bytes_per_token(self.kv_dtype)
        self.num_blocks = self.cache_config.num_blocks(bytes_per_token, self.scheduler_config.max_model_len,
                                                       available_memory(loaded.device))
        bs = self.cache_config.block_size
        log.info("KV cache: %s, %d blocks of %d tokens = %d tokens (%.0f MiB), %.1f max-length (%d) sequences",
                 self.kv_dtype.name, self.num_blocks, bs, self.num_blocks * bs,
                 self.num_blocks * bs * bytes_per_token / 2**20,
                 self.num_blocks * bs / self.scheduler_config.max_model_len, self.scheduler_config.max_model_len)
        self.kv = KVCacheManager(self.num_blocks, bs, self.cache_config.enable_prefix_caching,
                                 loaded.config.kv_window)
        if loaded.config.layer_windows:
            windows = sorted({w for w in loaded.config.layer_windows if w is not None})
            log.info("sliding-window attention: window %s on %d of %d layers%s", "/".join(map(str, windows)),
                     sum(w is not None for w in loaded.config.layer_windows), loaded.config.num_layers,
                     "; blocks out of the window are freed" if loaded.config.kv_window else
                     " (full-attention layers keep every block)")
        self.scheduler = Scheduler(self.scheduler_config, self.kv)
        self.runner = ModelRunner(loaded, self.num_blocks, bs, self.kv_dtype, seed, batch_invariant=batch_invariant)
        self.host = self._host_tier()  # first: its check of the memory left may refuse, before any thread starts
        if self.host is not None:
            self.kv.set_host_tier(self.host)
        self.disk = self._disk_tier()
        self.kv.disk = self.disk
        self.prefault_thread = self._prefault_for_disk()
        if self.runner.batch_invariant:
            log.info("batch-invariant: greedy output depends on the request only, not on the batch or the "
                     "prefix cache (--no-batch-invariant: prompt chunks take SDPA instead)")
        else:
            log.info("batch-invariant off%s: a greedy reply may change with what it is batched with and with "
                     "the prefix cache", "" if batch_invariant is False else " (the compiled attention kernel "
                     "does not run here)")
        self.spec_config = speculative
        self.spec_stats = SpecStats(speculative.num_speculative_tokens if speculative else 0)
        self.drafter = None
        if speculative is not None and speculative.method == "ngram":
            self.drafter = NgramDrafter(speculative, self.scheduler_config.max_model_len)
            log.info("speculative decoding: n-gram %d..%d, %d tokens, off above %d running requests",
                     speculative.prompt_lookup_min, speculative.prompt_lookup_max,
                     speculative.num_speculative_tokens, speculative.disable_by_batch_size)
        elif speculative is not None:
            if draft is None:
                raise SpeculativeConfigError("--speculative-config: method draft_model needs the draft model "
                                             "loaded (LLMEngine(draft=...))")
            from brisk.engine.spec_decode.draft_model import DraftModelProposer

            self.drafter = DraftModelProposer(speculative, loaded, draft, self.num_blocks, bs, self.kv_dtype,
                                              self.scheduler_config.max_model_len, self.runner.sampler.generator_of)
            log.info("speculative decoding: draft model %s (%d layers), %d tokens, off above %d running requests",
                     speculative.model, draft.config.num_layers, speculative.num_speculative_tokens,
                     speculative.disable_by_batch_size)
        self._ids = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_failed_requests: dict[str, int] = {}  # reason -> requests ended by an error of their own
        # prompt tokens run through the model (prefill; prefix-cache hits excluded, a preempted
        # request's recompute included): what "prompt tok/s" means in the stats line, as in vLLM
        self.num_prompt_tokens = 0

    # -- requests ---------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self._validate(ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, ids, params, priority=priority, cache_salt=cache_salt, prompt=text)
        request.detokenizer = self.tokenizer.detokenizer(params.skip_special_tokens)
        if params.grammar is not None:
            request.grammar = params.grammar.matcher()
        if params.tool_plan is not None:
            request.tool_calls = ToolCallParser(params.tool_plan)
        self.scheduler.add_request(request)
        self._pending[request_id] = _Pending()
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.scheduler_config.max_model_len
        if not ids:
            raise RequestError("prompt", "is empty; give at least one token")
        vocab = self.loaded.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params.pooling is not None:  # an embedding: the prompt alone, nothing generated
            if len(ids) > max_len:
                raise RequestError("prompt", f"{len(ids)} tokens exceed max_model_len {max_len}")
            return
        if len(ids) + params.max_tokens > max_len:
            raise RequestError(
                "max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds max_model_len {max_len}")

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it was unknown or already done."""
        request = self.scheduler.abort(request_id)
        self._forget(request_id)
        return request is not None

    def _forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.runner.sampler.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def _disk_tier(self) -> DiskTier | None:
        """The KV disk tier, when --kv-cache-dir names a folder: its fingerprint covers the model's files (names,
        sizes, times; a GGUF's own file, not its converted folder: a first start serves before that folder is
        written, and a conversion made again keeps the tier), its config, weight formats and dtype, the KV dtype
        and the block size."""
        cache = self.cache_config
        if cache.kv_cache_dir is None or not cache.enable_prefix_caching:
            return None
        loaded, folder = self.loaded, Path(self.loaded.model_dir)
        if loaded.report.format == "gguf":
            source = Path(loaded.report.path)
            files = [(source.name, source.stat().st_size, source.stat().st_mtime_ns)]
        else:
            files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()
                           if f.is_file() and f.suffix in (".safetensors", ".gguf", ".json", ".bin", ".model"))
        key = fingerprint(str(folder.resolve()), files, loaded.config, sorted(loaded.report.weight_formats.items()),
                             str(loaded.dtype), self.kv_dtype.name, cache.block_size)
        disk = DiskTier(cache.kv_cache_dir, key, cache.kv_cache_disk_bytes,
                        self.runner.kv.block_nbytes(cache.block_size))
        log.info("KV disk tier: %s (%.1f of %.1f GiB used, %d KB a block)", disk.folder, disk.disk_bytes() / 2**30,
                 cache.kv_cache_disk_bytes / 2**30, disk.block_bytes // 1024)
        return disk

    def _prefault_for_disk(self) -> threading.Thread | None:
        """With a disk tier that holds blocks (a restart), map in as many of the pool's first blocks as it holds,
        on a thread at a lower priority, so that the prefixes read back land in memory already mapped: the first
        touch of fresh memory cost 1.6 ms a 360 KB block on the 2-core VM, 9x the copy itself
        (benchmarks/RESULTS.md). The pool's first blocks are the ones a new engine hands out first."""
        self.prefaulted_bytes = 0
        if self.disk is None or self.loaded.device.type != "cpu":
            return None
        bs = self.cache_config.block_size
        blocks = min(self.num_blocks, self.disk.size_bytes // (self.disk.block_bytes + HEADER_BYTES))
        if blocks == 0:
            return None

        def prefault() -> None:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            t0 = time.perf_counter()
            self.prefaulted_bytes = mapped = self.runner.kv.prefault(blocks * bs)
            log.info("KV pool: %d MiB of its first %d blocks mapped in for the disk tier's blocks in %.2f s",
                     mapped >> 20, blocks, time.perf_counter() - t0)

        thread = threading.Thread(target=prefault, name="brisk-kv-prefault", daemon=True)
        thread.start()
        return thread

    def _host_tier(self) -> HostTier | None:
        """The KV host tier, when --kv-cache-host-bytes is set: the cached blocks the pool evicts, in host memory."""
        cache = self.cache_config
        if not cache.kv_cache_host_bytes or not cache.enable_prefix_caching:
            return None
        free = host_available_memory()
        if self.loaded.device.type == "cpu":
            free -= self.runner.kv.nbytes - (self.runner.kv.resident_bytes() or 0)  # the pool fills in as it is used
        if cache.kv_cache_host_bytes > free:
            raise BriskError(f"--kv-cache-host-bytes {cache.kv_cache_host_bytes / 2**30:.1f} GiB is more than the "
                             f"{max(free, 0) / 2**30:.1f} GiB of host memory left once the KV pool is full; give it "
                             "less (or the pool less: --kv-cache-memory)")
        host = HostTier(cache.kv_cache_host_bytes, self.runner.kv.block_nbytes(cache.block_size))
        log.info("KV host tier: %.1f GiB, %d blocks of %d KB", host.max_bytes / 2**30,
                 host.max_bytes // host.block_bytes, host.block_bytes // 1024)
        return host

    def _sync_tiers(self, before_forward: bool) -> None:
        """Before the step's forward (and its drafts): copy the blocks the pool evicted out to the host tier,
        then the blocks taken from the host tier or read from disk into the pool (in that order: a block the
        pool reuses may take a loaded block's bytes). After the forward: hand the blocks the step filled to the
        disk tier's writer (a copy of their bytes; the writing happens off this thread)."""
        bs = self.cache_config.block_size
        if before_forward:
            spilled = {block_id: (block_hash, self.runner.kv.read_block(block_id, bs))
                       for block_id, block_hash in self.kv.take_spills()}
            loads = self.kv.take_loads()
            taken_back = {payload.block_id for _, payload in loads if isinstance(payload, PendingSpill)}
            for block_id, (block_hash, payload) in spilled.items():
                if block_id not in taken_back:  # (one taken back in this step is in the pool again)
                    self.host.put(block_hash, payload)
            for block_id, payload in loads:
                if isinstance(payload, PendingSpill):
                    payload = spilled[payload.block_id][1]
                self.runner.kv.write_block(block_id, bs, payload)
        elif self.disk is not None:
            for block_id, block_hash in self.kv.take_written():
                self.disk.put(block_hash, self.runner.kv.read_block(block_id, bs))

    def close(self) -> None:
        """Write out what the disk tier has queued (a drained shutdown keeps every computed block)."""
        if self.disk is not None:
            self.disk.close()

    # -- one step ---------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the model, sample, append. A failure in one request's own work (drafting,
        sampling, detokenizing, stop strings, its grammar or tool-call reader) ends that request with an
        error output and frees its blocks; the others go on. Only the shared forward may raise."""
        failed: list[RequestOutput] = []
        if self.drafter is not None:
            self._propose(failed)
        out = self.scheduler.schedule()
        if not out.chunks:
            if self.disk is not None and self.kv.disk_reads_under_way():
                self.disk.wait_read(DISK_READ_WAIT_S)  # nothing runs until a prefix comes from disk
            return failed
        tiers = self.disk is not None or self.host is not None
        if tiers:
            self._sync_tiers(before_forward=True)
        if self.drafter is not None:
            self.drafter.draft(out.chunks)
        rows = self.runner.execute(out.chunks)
        if tiers:
            self._sync_tiers(before_forward=False)
        for chunk in out.chunks:  # before advance: num_computed_tokens is still where the chunk starts
            prompt_left = chunk.request.num_prompt_tokens - chunk.request.num_computed_tokens
            if prompt_left > 0:
                self.num_prompt_tokens += min(chunk.num_tokens, prompt_left)
        self.scheduler.advance(out)
        self.num_steps += 1
        embedded = [self._embedded(c.request) for c in out.chunks
                    if c.request.embedding is not None and not c.request.status.finished]
        if rows is None:
            return failed + embedded
        return failed + embedded + self._sample_and_append(rows)

    def _embedded(self, request: Request) -> RequestOutput:
        """An embedding request whose prompt is computed: it ends with its pooled vector (its "first token")."""
        request.times.first_token_ts = time.monotonic()
        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        self._forget(request.request_id)
        out = self._output(request, "", [])
        out.embedding = request.embedding
        return out

    def _propose(self, failed: list[RequestOutput]) -> None:
        """Drafts for the running requests (before scheduling: a request that fails here holds no block of
        this step)."""
        for request, error in self.drafter.propose(self.scheduler.running):
            failed.append(self._fail(request, "internal_error", error))

    def _sample_and_append(self, rows) -> list[RequestOutput]:
        """Sample every request at once; if that raises, each request by itself (from the same logits and
        random state), so that only the request whose sampling fails fails."""
        states = self.runner.sampler.random_states(rows.requests)
        try:
            samples = self.runner.sample(rows)
        except Exception as batch_error:  # noqa: BLE001 - find whose it is: each request alone
            log.warning("sampling the step's %d requests together failed (%r); sampling each alone",
                        len(rows.requests), batch_error)
            self.runner.sampler.restore_random_states(states)
            outputs = []
            for request, result in zip(rows.requests, self.runner.sample_each(rows)):
                if isinstance(result, Exception):
                    outputs.append(self._fail(request, "internal_error", result))
                else:
                    outputs += self._append_samples([request], result)
            return outputs
        return self._append_samples(rows.requests, samples)

    def _append_samples(self, sampled: list[Request], samples) -> list[RequestOutput]:
        token_ids = samples.token_ids.tolist()  # the step's one host sync
        extras = None
        if samples.logprobs is not None:
            extras = (samples.logprobs.tolist(), samples.top_ids.tolist(), samples.top_logprobs.tolist())
        now = time.monotonic()
        num_rows = samples.num_rows or [1] * len(sampled)
        num_emitted = samples.num_emitted or [1] * len(sampled)
        outputs, row = [], 0
        for request, rows, emitted in zip(sampled, num_rows, num_emitted):
            try:
                if rows > 1:  # booked first: a final output's metrics include this step's draft
                    self.spec_stats.record(rows - 1, emitted - 1)
                    request.spec.record(rows - 1, emitted - 1, self.spec_config.min_acceptance_rate)
                outputs.append(self._append_tokens(request, token_ids[row:row + emitted], now, extras, row))
                if rows > 1:
                    self._verified(request)
            except GrammarRejectedError as e:
                outputs.append(self._fail(request, e.reason, str(e), getattr(e, "field", None)))
            except Exception as e:  # noqa: BLE001 - this request's own failure: it ends, the others go on
                outputs.append(self._fail(request, "internal_error", e))
            row += rows
        return outputs

    def _fail(self, request: Request, reason: str, error: BaseException | str,
              param: str | None = None) -> RequestOutput:
        """End a request with an error its client sees (`reason`: internal_error, grammar_rejected), free its
        blocks, and log the traceback once."""
        if isinstance(error, BaseException):
            log.error("request %s failed (%s); the other requests go on", request.request_id, reason,
                      exc_info=error)
            message = f"an internal error ended request {request.request_id} ({type(error).__name__}); the " \
                      "server log has the details"
        else:
            log.warning("request %s failed (%s): %s", request.request_id, reason, error)
            message = f"request {request.request_id}: {error}"
        request.error = (reason, message, param)
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self._forget(request.request_id)
        self.num_failed_requests[reason] = self.num_failed_requests.get(reason, 0) + 1
        return self._output(request, "", [])

    def _verified(self, request: Request) -> None:
        """After a verified draft, a request still running keeps the K/V of its accepted drafts
        (computed this step) and gives back the rejected ones' slots."""
        request.spec_token_ids = []
        if not request.status.finished:
            request.num_computed_tokens = request.num_tokens - 1
            self.kv.truncate(request.request_id, request.num_computed_tokens)
            # a draft model's K/V stays valid up to the last accepted position
            request.spec.draft_computed = min(request.spec.draft_computed, request.num_computed_tokens)

    def _append_tokens(self, request: Request, tokens: list[int], now: float, extras, row: int) -> RequestOutput:
        """Append a step's tokens (one, or several after a verified draft) until the request
        finishes; one output carries them all."""
        old_len = request.num_output_tokens
        released = []
        for i, token in enumerate(tokens):
            released.append(self._append_token(request, token, now, extras, row + i))
            if request.status.finished:
                break
        return self._output(request, "".join(released), request.output_tokens_from(old_len))

    def _append_token(self, request: Request, token: int, now: float, extras, row: int) -> str:
        """Append one token, apply the stop rules; returns the text it releases."""
        request.append_output(token)
        request.times.token_ts.append(now)
        if request.times.first_token_ts is None:
            request.times.first_token_ts = now
        self.num_generated_tokens += 1
        params = request.params
        if extras is not None and params.logprobs is not None:
            chosen, top_ids, top_lps = extras
            k = params.logprobs
            request.logprobs.append({"token_id": token, "logprob": chosen[row],
                                     "top": list(zip(top_ids[row][:k], top_lps[row][:k]))})
        pending = self._pending[request.request_id]
        pending.text += request.detokenizer.step(token)
        status = None
        if token in params.stop_token_ids:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif token in self.tokenizer.eos_token_ids and not params.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and self._grammar_done(request, token):
            status = status or RequestStatus.FINISHED_STOPPED
        hit = None
        if params.stop:  # search the new text and the tail a stop string could have started in
            tail = request.output_text[max(0, len(request.output_text) - stop_window(params.stop)):]
            hit = find_stop(tail + pending.text, params.stop, len(tail))
        if hit is not None:
            idx, stop = hit
            end = idx + len(stop) if params.include_stop_str_in_output else idx
            pending.text = (tail + pending.text)[len(tail):end]
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        elif status is None and (request.num_output_tokens >= params.max_tokens
                                 or request.num_tokens >= self.scheduler_config.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            keep = held_back_length(pending.text, params.stop) if params.stop else 0
            release, pending.text = pending.text[:len(pending.text) - keep], pending.text[len(pending.text) - keep:]
        else:
            release, pending.text = pending.text, ""
        request.output_text += release
        if request.tool_calls is not None and status is None:
            request.tool_calls.feed(release)
            if request.tool_calls.repeated:  # the reply began to loop on one call: it is over
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, REPEATED_TOOL_CALL
        if status is not None:
            self.scheduler.finish(request, status)
            self._forget(request.request_id)
        return release

    @staticmethod
    def _grammar_done(request: Request, token: int) -> bool:
        """Advance the sequence's grammar; True once it admits no further token (the output is complete).
        A grammar no token continues (computing its mask put the matcher in error: the text it needs is
        not writable with this vocabulary) raises GrammarUnsatisfiableError; a token the grammar rejects
        although its mask allowed it (a bug in the grammar library) raises GrammarRejectedError. Either way
        the request fails with that reason, never a reply that looks complete."""
        matcher = request.grammar
        if matcher.is_error():
            field = getattr(getattr(request.params.grammar, "spec", None), "field", None)
            name = field or "the grammar"
            raise GrammarUnsatisfiableError(
                f"{name} cannot be met with this model: after {request.num_output_tokens - 1} generated "
                f"tokens no token of its vocabulary continues it (it needs text the vocabulary cannot write); "
                f"change {name} or use a model whose vocabulary writes that text", field)
        if not matcher.consume_token(token):
            why = (matcher.get_error() or "").strip().splitlines()
            raise GrammarRejectedError(f"the grammar rejected token {token}, which its own mask allowed"
                                       f"{f' ({why[0][:200]})' if why else ''}; the reply cannot go on")
        return matcher.is_stopped()

    def _output(self, request: Request, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        finished = request.status.finished
        whole = finished or request.params.output_kind == "cumulative"
        logprobs = delta_logprobs = None
        if request.params.logprobs is not None:
            logprobs = request.logprobs if whole else None
            delta_logprobs = request.logprobs[len(request.logprobs) - len(delta_ids):]
        # the prompt's ids ride on a request's first output and on whole ones, not on every delta
        first = request.num_output_tokens == len(delta_ids)
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids if whole or first else [],
            text=request.output_text if whole else "", token_ids=request.output_tokens_from(0) if whole else [],
            delta_text=delta_text, delta_token_ids=delta_ids, finished=finished,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason, logprobs=logprobs,
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_disk_prompt_tokens=request.num_disk_prompt_tokens,
            num_host_prompt_tokens=request.num_host_prompt_tokens,
            metrics=self._metrics(request) if whole else {}, num_output_tokens=request.num_output_tokens,
            delta_logprobs=delta_logprobs, text_offset=len(request.output_text) - len(delta_text),
            error=request.error,
        )

    @staticmethod
    def _metrics(request: Request) -> dict:
        metrics = {**request.times.phases_ms(), "num_preemptions": request.num_preemptions}
        if request.spec is not None:
            metrics["spec_drafted_tokens"] = request.spec.num_drafted
            metrics["spec_accepted_tokens"] = request.spec.num_accepted
        if request.status.finished:
            t = request.times
            metrics["itl_ms"] = [round(gap, 3) for gap in t.itl_ms()]
            # monotonic seconds, for tracing spans placed on the engine's own clock
            metrics["timestamps"] = {"arrival": t.arrival_ts, "first_scheduled": t.first_scheduled_ts,
                                     "first_token": t.first_token_ts, "finished": t.finished_ts}
        return metrics

    def block_map(self) -> dict:
        """The KV block pool as the web page draws it (GET /v1/brisk/engine): each block's state (the index of the
        request holding it, -1 free, -2 free but holding a cached prefix), the shared ones, and the requests."""
        owners, shared, cached = self.kv.block_owners()
        ids = list(dict.fromkeys(o for o in owners if o is not None))
        index = {rid: i for i, rid in enumerate(ids)}
        requests = []
        for rid in ids:
            request = self.scheduler.requests.get(rid)
            requests.append({"id": rid, "status": request.status.value if request else "finished",
                             "tokens": request.num_tokens if request else 0,
                             "computed": request.num_computed_tokens if request else 0,
                             "cached_prompt_tokens": request.num_cached_prompt_tokens if request else 0})
        state = [index[o] if o is not None else (-2 if c else -1) for o, c in zip(owners, cached)]
        return {"block_size": self.kv.block_size, "blocks": state, "shared": [i for i, s in enumerate(shared) if s],
                "requests": requests}

    def stats(self) -> EngineStats:
        usage = self.kv.usage()
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=usage.num_blocks, kv_blocks_used=usage.num_used_blocks,
            kv_blocks_cached_free=usage.num_cached_free_blocks,
            kv_blocks_free=usage.num_blocks - usage.num_used_blocks, kv_usage=usage.usage,
            kv_internal_fragmentation=usage.internal_fragmentation,
            prefix_cache_queries_tokens=self.kv.prefix_queries_tokens,
            prefix_cache_hits_tokens=self.kv.prefix_hits_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            prompt_tokens=self.num_prompt_tokens, generation_tokens=self.num_generated_tokens,
            spec_draft_tokens=self.spec_stats.num_drafted, spec_accepted_tokens=self.spec_stats.num_accepted,
            spec_acceptance_lengths=tuple(self.spec_stats.acceptance_lengths),
            kv_cache_bytes=self.runner.kv.nbytes, kv_cache_resident_bytes=self.runner.kv.resident_bytes() or 0,
            kv_cache_dtype=self.kv_dtype.name, **self._disk_stats(), **self._host_stats(),
        )

    def _host_stats(self) -> dict:
        if self.host is None:
            return {}
        h = self.host.stats
        return {"kv_host_hits_tokens": self.kv.host_hits_tokens, "kv_host_misses_tokens": self.kv.host_misses_tokens,
                "kv_host_blocks_read": h.hits,
                "kv_host_blocks_stored": h.stored, "kv_host_blocks_evicted": h.evicted,
                "kv_host_budget_bytes": self.host.max_bytes, "kv_host_bytes": self.host.size_bytes}

    def _disk_stats(self) -> dict:
        if self.disk is None:
            return {}
        d = self.disk.stats
        return {"kv_disk_hits_tokens": self.kv.disk_hits_tokens, "kv_disk_misses_tokens": self.kv.disk_misses_tokens,
                "kv_disk_blocks_read": d.hits,
                "kv_disk_blocks_corrupt": d.corrupt, "kv_disk_blocks_written": d.written,
                "kv_disk_blocks_not_written": d.dropped + d.write_errors, "kv_disk_budget_bytes": self.disk.max_bytes,
                "kv_disk_bytes": self.disk.size_bytes, "kv_disk_loads": d.loads, "kv_disk_load_seconds": d.load_seconds}
