"""Paged KV blocks with a prefix cache.

A request's KV lives in fixed-size blocks listed in its block table. When prefix caching is on,
every *full* block is identified by a hash chained over all tokens before it, so two requests
whose prompts share a prefix of whole blocks share those blocks (reference counted). Blocks whose
count drops to zero go to the back of a free queue but keep their hash: a later request with the
same prefix revives them; allocation evicts from the front, so the least recently freed goes first.

Block 0 is never handed out: the runner points padding tokens at it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from meshserve.engine.request import Request

NULL_BLOCK = 0


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


class BlockManager:
    """Allocates KV blocks to requests; owns the prefix cache's hash table and LRU order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order; values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[int]] = {}  # chained hashes of a request's full blocks
        self.stats = PrefixCacheStats()

    # ---------------------------------------------------------------- queries
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._req_blocks.get(request_id, [])

    # ---------------------------------------------------------------- prefix cache
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of ``request``; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        hashes = self._hashes_for(request.request_id, tokens, (len(tokens) - 1) // self.block_size)
        hit: list[int] = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the hashes of the request's blocks whose KV is now computed in full."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks[request.request_id]
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        hashes = self._hashes_for(request.request_id, request.all_token_ids, num_full)
        for block_id, block_hash in zip(blocks[:num_full], hashes):
            block = self.blocks[block_id]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block_id

    def _hashes_for(self, request_id: str, tokens: list[int], num_blocks: int) -> list[int]:
        hashes = self._req_hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash((parent, tuple(tokens[i * bs:(i + 1) * bs]))))
        return hashes[:num_blocks]

    # ---------------------------------------------------------------- allocation
    def allocate(self, request: Request, num_new_tokens: int,
                 cached_blocks: list[int] | None = None) -> list[int] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_blocks`` (from ``find_cached_prefix``) become the head of a new request's table.
        Returns the newly added block ids, or None (changing nothing) when blocks run out.
        """
        cached_blocks = cached_blocks or []
        table = self._req_blocks.get(request.request_id, [])
        # request.num_computed_tokens already counts the cached prefix.
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if max(needed, 0) + revived > self.num_free_blocks:
            return None
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        new_ids = [self._take_free_block() for _ in range(max(needed, 0))]
        self._req_blocks[request.request_id] = table + cached_blocks + new_ids
        return cached_blocks + new_ids

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content
            del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release a request's blocks; hashed ones stay revivable until evicted."""
        self._req_hashes.pop(request.request_id, None)
        # Tail blocks first, so a prompt's later blocks are evicted before its earlier ones.
        for block_id in reversed(self._req_blocks.pop(request.request_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self._cached.items()):
            if self.blocks[block_id].ref_count == 0:
                self.blocks[block_id].block_hash = None
                del self._cached[block_hash]
