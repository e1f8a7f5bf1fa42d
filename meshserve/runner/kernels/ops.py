"""``meshserve_cpu::layer_attention``: the cpu backend's attention, one opaque op per layer.

The op takes the step's queries and new keys/values plus the step's metadata, and names its
layer's KV cache by an integer id rather than taking the cache tensors as arguments. So a compiled
forward never has the cache among its graph inputs: torch.compile sees an op that maps (q, k, v,
metadata) to an output, does not functionalize the cache (which would copy all of it every
step), and the kernel writes and reads the cache in place. This is vLLM's arrangement too (its
attention op finds the cache through a forward context).

The kernel library keeps the table of caches (``register_kv_cache``) and looks each layer's up
itself, so a compiled forward calls straight into C++: a Python op in between cost ~15 us a
layer, about 1% of a 32-sequence decode step of SmolLM2-135M. Caches are held weakly: the
runner that allocated them owns them, and an engine that is dropped frees its cache even though
its ids stay in the table.
"""

from __future__ import annotations

import threading

import torch

from meshserve.runner import kernels

_lock = threading.Lock()
_fake_registered = False


def load() -> None:
    """Load the kernels and tell torch.compile the output of ``layer_attention``."""
    global _fake_registered
    kernels.load()
    with _lock:
        if not _fake_registered:
            torch.library.register_fake("meshserve_cpu::layer_attention")(_layer_attention_fake)
            _fake_registered = True


def _layer_attention_fake(query, key, value, slot_mapping, block_tables, query_start_loc,
                          seq_lens, cache_id, scale, window):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def register_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """Make one layer's cache reachable from the op; returns the id the layer passes to it."""
    load()
    return torch.ops.meshserve_cpu.register_kv_cache(key_cache, value_cache)


def layer_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, cache_id: int,
                    scale: float, window: int) -> torch.Tensor:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into cache ``cache_id`` at ``slot_mapping`` ``[T]``,
    then attend ``query`` ``[T, H, D]``; sequence ``s`` owns tokens
    ``query_start_loc[s]:query_start_loc[s + 1]`` and has ``seq_lens[s]`` tokens of context (this
    step's included), in the blocks of ``block_tables[s]``. ``window`` 0: full attention. A cache
    that was freed raises ``RuntimeError``."""
    return torch.ops.meshserve_cpu.layer_attention(
        query, key, value, slot_mapping, block_tables, query_start_loc, seq_lens, cache_id,
        scale, window)


def arithmetic(dtype: torch.dtype, head_dim: int, block_size: int) -> str:
    """The arithmetic the kernel attends a cache of this dtype and shape with on this machine:
    ``"tiles"`` (bf16 on AMX), ``"pairs"`` (bf16 on AVX-512 BF16 without AMX, or where Linux
    refuses the tile state) or ``"floats"`` (fp32 arithmetic, everything else); no faster than
    ``MESHSERVE_CPU_ATTENTION`` allows (see ``meshserve.runner.kernels``). A value of that
    variable other than ``auto``, ``tiles``, ``pairs`` or ``floats`` raises here, and in the
    first attention call."""
    kernels.load()
    return torch.ops.meshserve_cpu.arithmetic(dtype, head_dim, block_size)


def paired_blocks(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether the kernel keeps a cache of this dtype and shape paired on this machine (the
    ``"tiles"`` and ``"pairs"`` arithmetics): each block's keys as
    ``[head_dim / 2, block_size, 2]`` and its values as ``[block_size / 2, head_dim, 2]`` within the
    tensors' memory. Only code that reads a cache's contents (tests) needs to know; the tensors'
    shapes are the same either way."""
    return arithmetic(dtype, head_dim, block_size) != "floats"
