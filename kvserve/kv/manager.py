"""The KV-cache manager: which blocks each request holds, prefix-cache lookups, allocation and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.request import Request
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import extend_block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counts over admissions: `hits / queries` is the prefix-cache hit rate."""

    num_queries: int = 0
    num_hits: int = 0


class KVCacheManager:
    """Maps requests to blocks of the pool. Block ids are handed to the runner in `SchedulerOutput`."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[
            str, int
        ] = {}  # leading blocks already registered in the cache
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request being admitted: (block ids, number of tokens).

        At most num_tokens - 1 tokens come from the cache: the last one must be computed to sample from it.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._block_hashes(request)[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.stats.num_queries += request.num_tokens
        self.stats.num_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` (+ lookahead) after the request's computed tokens.

        `computed_block_ids` are prefix-cache hits found at admission; they count as computed. Returns False,
        changing nothing, when the pool cannot supply the blocks.
        """
        computed_block_ids = computed_block_ids or []
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_block_ids) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_to_allocate = num_required - len(held) - len(computed_block_ids)
        # Cache hits sitting in the free queue stop being allocatable once we reference them.
        num_revived = sum(1 for b in computed_block_ids if self.pool.is_free(b))
        if num_to_allocate + num_revived > self.pool.num_free_blocks:
            return False
        if computed_block_ids:
            self.pool.touch(computed_block_ids)
            self._num_cached_blocks[request.request_id] = len(held) + len(computed_block_ids)
        new_ids = self.pool.allocate(num_to_allocate) if num_to_allocate > 0 else []
        self._blocks[request.request_id] = held + computed_block_ids + new_ids
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks under their chained hashes."""
        if not self.enable_prefix_caching:
            return
        # A request that stopped inside a run of accepted proposals has computed past its last token.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self._blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release all of a request's blocks. Tail blocks go first in the eviction order: a shared prefix
        outlives the unique suffixes that followed it."""
        blocks = self._blocks.pop(request.request_id, [])
        self.pool.free(list(reversed(blocks)))
        self._hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)

    def crop(self, request: Request, num_tokens: int) -> None:
        """Drop blocks past the first `num_tokens` tokens (speculative rollback, trimmed lookahead)."""
        blocks = self._blocks.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(blocks):
            self.pool.free(list(reversed(blocks[keep:])))
            del blocks[keep:]

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for request_id, blocks in self._blocks.items():
            assert len(set(blocks)) == len(blocks), f"{request_id} holds a block twice"
            for block_id in blocks:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} holders"
            )
