"""The engine most tests run on: the demo model, a fixed pool and the server's scheduler limits
(a shared helper; test modules import it instead of importing one another)."""

from brisk.config import CacheConfig
from brisk.engine.engine import LLMEngine
from brisk.engine.scheduler import SchedulerConfig


def make_engine(demo, num_blocks=None, max_num_seqs=64, max_num_batched_tokens=512, prefix=True, block_size=16,
                batch_invariant=None, kv_cache_dtype="auto"):
    return LLMEngine(demo, CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks or 2048,
                                       enable_prefix_caching=prefix, kv_cache_dtype=kv_cache_dtype),
                     SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=1024), batch_invariant=batch_invariant)
