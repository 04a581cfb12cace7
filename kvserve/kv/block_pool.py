"""A pool of fixed-size KV blocks: reference counts, a free queue in eviction order, and the prefix cache.

Invariant (checked by `check_invariants`): every block with ref_cnt == 0 is in the free queue and no other
block is; a block with a hash is the one the cache map names for that hash. A freed block that has a hash stays
cached until it is evicted from the front of the queue, least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    tag: int = 0  # the KV group it was allocated for (kv/groups.py)


class BlockPool:
    """Owns every block's bookkeeping; the tensors live in the model runner."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_reserved: int = 0) -> None:
        """`num_reserved`: blocks 0 .. num_reserved - 1 are never handed out (a hybrid cache's null
        block, kv/groups.py); `num_blocks` counts the others."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_reserved = num_reserved
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_reserved + num_blocks)]
        # Front = evicted first. Values unused: an ordered set with O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_reserved, num_reserved + num_blocks)
        )
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.in_use_by_tag: dict[int, int] = {}  # referenced blocks per allocation tag

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request."""
        return 1.0 - len(self._free) / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int, tag: int = 0) -> list[int]:
        """Take `num_blocks` blocks from the front of the free queue, evicting their cached contents;
        `tag` names what they hold (a KV group), counted in `in_use_by_tag` while referenced."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks with {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            block.tag = tag
            block_ids.append(block_id)
        if num_blocks:
            self.in_use_by_tag[tag] = self.in_use_by_tag.get(tag, 0) + num_blocks
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); unreferenced ones leave the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                self.in_use_by_tag[block.tag] = self.in_use_by_tag.get(block.tag, 0) + 1
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each, in the given order; blocks reaching zero join the back of the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                self.in_use_by_tag[block.tag] -= 1

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, computed block under its chained hash. If an identical block is already
        cached the new one stays uncached (a duplicate); it is freed like any other block."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def check_invariants(self) -> None:
        num_in_use = 0
        for block in self.blocks[: self.num_reserved]:
            assert block.ref_cnt == 0 and block.block_hash is None, "a reserved block was used"
            assert block.block_id not in self._free, "a reserved block is in the free queue"
        for block in self.blocks[self.num_reserved :]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_free = block.block_id in self._free
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue = {in_free}"
            )
            num_in_use += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, "hash map out of sync"
        assert len(self._free) + num_in_use == self.num_blocks, "free + in use != total"
        by_tag: dict[int, int] = {}
        for block in self.blocks:
            if block.ref_cnt > 0:
                by_tag[block.tag] = by_tag.get(block.tag, 0) + 1
        assert by_tag == {t: n for t, n in self.in_use_by_tag.items() if n}, "tag counts drifted"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, (
                "cached map names a rehashed block"
            )
        if not self.enable_caching:
            assert not self._cached, "caching disabled but blocks are cached"
