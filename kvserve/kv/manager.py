"""The KV-cache manager: which blocks each request holds, prefix-cache lookups, allocation and freeing."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.request import Request
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.groups import NULL_BLOCK, KVLayout, single_layout
from kvserve.kv.hashing import extend_block_hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counts over admissions: `hits / queries` is the prefix-cache hit rate."""

    num_queries: int = 0
    num_hits: int = 0


GroupBlocks = tuple[list[int], ...]  # one block list per KV group (kv/groups.py)


class KVCacheManager:
    """Maps requests to blocks of the pool, one block table per KV group (kv/groups.py; a model whose
    layers all see the whole context has one). Block ids are handed to the runner in `SchedulerOutput`.

    Window groups return the blocks that no later query of a request can see while it runs (their
    entries become `NULL_BLOCK`); a prefix-cache hit counts only as far as every group can serve it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        layout: KVLayout | None = None,
    ) -> None:
        """`num_blocks`: blocks of the runner's tensors; a hybrid layout keeps block 0 as its null block."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or single_layout(1)
        self.groups = self.layout.groups
        reserved = 1 if self.layout.hybrid else 0
        if num_blocks <= reserved:
            raise ValueError(f"num_blocks must be > {reserved}, got {num_blocks}")
        self.pool = BlockPool(num_blocks - reserved, enable_prefix_caching, num_reserved=reserved)
        self._blocks: dict[str, GroupBlocks] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[
            str, int
        ] = {}  # leading blocks already registered in the cache (every group)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        """Blocks that requests can hold (the null block of a hybrid layout excluded)."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        """The request's table of the first group (full attention; the only one of most models)."""
        tables = self._blocks.get(request_id)
        return tables[0] if tables else []

    def group_block_ids(self, request_id: str) -> GroupBlocks:
        """The request's table of every group; a window group's entries before its window are
        `NULL_BLOCK`."""
        return self._blocks.get(request_id, tuple([] for _ in self.groups))

    def num_held(self, request_id: str) -> list[int]:
        """Blocks the request holds now, per group (null entries not counted)."""
        return [
            sum(1 for b in table if not (group.window is not None and b == NULL_BLOCK))
            for group, table in zip(self.groups, self.group_block_ids(request_id), strict=True)
        ]

    def blocks_in_use(self) -> list[int]:
        """Blocks that requests hold, per group (a block shared by several counts once)."""
        return [self.pool.in_use_by_tag.get(index, 0) for index in range(len(self.groups))]

    def num_blocks_for(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once (prompt chunks of at most
        `max_chunk` tokens; None: the whole prompt in one)."""
        return self.layout.max_blocks(num_tokens, self.block_size, max_chunk or num_tokens)

    def _block_hashes(self, request: Request) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return hashes

    def _key(self, block_hash: bytes, group: int) -> bytes:
        """The cache key of a block of group `group`: groups hold the same tokens in different blocks."""
        return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

    def _servable(self, present: list[list[bool]], num_blocks: int) -> int:
        """The longest prefix of at most `num_blocks` blocks that every group can serve, given which
        blocks each group has (`present[g][i]`): a full group needs every block before it, a window
        group only those that the next query (at the prefix's end) still sees."""
        for hit in range(num_blocks, 0, -1):
            ok = True
            for group, have in zip(self.groups, present, strict=True):
                first = group.first_needed_block(hit * self.block_size, self.block_size)
                if not all(have[first:hit]):
                    ok = False
                    break
            if ok:
                return hit
        return 0

    def _prefix(self, tables: list[list[int | None]], hit: int) -> GroupBlocks:
        """The first `hit` entries of each group's table, window entries before the window as null."""
        out = []
        for group, table in zip(self.groups, tables, strict=True):
            first = group.first_needed_block(hit * self.block_size, self.block_size)
            out.append([NULL_BLOCK] * first + [int(b) for b in table[first:hit]])
        return tuple(out)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of a request being admitted: (block ids per group, number of tokens).

        At most num_tokens - 1 tokens come from the cache: the last one must be computed to sample from it.
        """
        empty = tuple([] for _ in self.groups)
        if not self.enable_prefix_caching:
            return empty, 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request)[:max_hit_blocks]
        # the full group's hits end at its first miss; a window group's may have gaps before the end
        first: list[int | None] = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            first.append(block_id)
        tables: list[list[int | None]] = [first]
        for index in range(1, len(self.groups)):
            tables.append([self.pool.lookup(self._key(h, index)) for h in hashes[: len(first)]])
        present = [[b is not None for b in t] for t in tables]
        hit = self._servable(present, len(first)) if self.layout.hybrid else len(first)
        self.stats.num_queries += request.num_tokens
        self.stats.num_hits += hit * self.block_size
        if hit == 0:
            return empty, 0
        return self._prefix(tables, hit), hit * self.block_size

    def shared_prefix(self, source_id: str, max_blocks: int) -> tuple[GroupBlocks, int]:
        """The longest prefix of a running request's first `max_blocks` blocks that another request (a
        sibling sample of the same prompt) can share by reference: (block ids per group, tokens)."""
        tables = self.group_block_ids(source_id)
        max_blocks = min([max_blocks] + [len(t) for t in tables])
        present = [
            [not (g.window is not None and b == NULL_BLOCK) for b in t[:max_blocks]]
            for g, t in zip(self.groups, tables, strict=True)
        ]
        hit = self._servable(present, max_blocks) if self.layout.hybrid else max_blocks
        return self._prefix(list(tables), hit), hit * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for `num_new_tokens` (+ lookahead) after the request's computed tokens.

        `computed_blocks` are prefix-cache (or sibling) hits found at admission, per group; they count as
        computed. Window groups first return the blocks that no query from the computed position on can
        see. Returns False when the pool cannot supply the blocks, changing nothing else.
        """
        held = self._blocks.get(request.request_id)
        if held is None:
            held = tuple([] for _ in self.groups)
        computed = computed_blocks or tuple([] for _ in self.groups)
        num_hit = len(computed[0]) if computed else 0
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        self._release_outside_windows(held, num_computed)
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_to_allocate = [
            num_required - len(h) - len(c) for h, c in zip(held, computed, strict=True)
        ]
        num_to_allocate = [max(0, n) for n in num_to_allocate]
        touched = [
            b
            for group, ids in zip(self.groups, computed, strict=True)
            for b in ids
            if group.window is None or b != NULL_BLOCK
        ]
        # Cache hits sitting in the free queue stop being allocatable once we reference them.
        num_revived = sum(1 for b in touched if self.pool.is_free(b))
        if sum(num_to_allocate) + num_revived > self.pool.num_free_blocks:
            return False
        if touched:
            self.pool.touch(touched)
        if num_hit:
            self._num_cached_blocks[request.request_id] = len(held[0]) + num_hit
        self._blocks[request.request_id] = tuple(
            h + list(c) + (self.pool.allocate(n, index) if n > 0 else [])
            for index, (h, c, n) in enumerate(zip(held, computed, num_to_allocate, strict=True))
        )
        return True

    def _release_outside_windows(self, tables: GroupBlocks, num_computed: int) -> None:
        """Return each window group's blocks that end before the window of position `num_computed`
        (the first query still to run): the query there and every later one never read them."""
        for group, table in zip(self.groups, tables, strict=True):
            first = min(group.first_needed_block(num_computed, self.block_size), len(table))
            freed = [b for b in table[:first] if b != NULL_BLOCK]
            if freed:
                self.pool.free(list(reversed(freed)))
                table[:first] = [NULL_BLOCK] * first

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks under their chained hashes (every group's)."""
        if not self.enable_prefix_caching:
            return
        # A request that stopped inside a run of accepted proposals has computed past its last token.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        tables = self._blocks[request.request_id]
        for index, table in enumerate(tables):
            window = self.groups[index].window is not None
            for i in range(start, num_full):
                if not (window and table[i] == NULL_BLOCK):  # returned before it was cached
                    self.pool.cache_block(table[i], self._key(hashes[i], index))
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release all of a request's blocks. Tail blocks go first in the eviction order: a shared prefix
        outlives the unique suffixes that followed it."""
        tables = self._blocks.pop(request.request_id, ())
        for group, table in zip(self.groups, tables, strict=False):  # () when none held
            real = [b for b in table if group.window is None or b != NULL_BLOCK]
            self.pool.free(list(reversed(real)))
        self._hashes.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for request_id, tables in self._blocks.items():
            for group, blocks in zip(self.groups, tables, strict=True):
                real = [b for b in blocks if group.window is None or b != NULL_BLOCK]
                assert len(set(real)) == len(real), f"{request_id} holds a block twice"
                for block_id in real:
                    refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.pool.blocks[self.pool.num_reserved :]:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} holders"
            )
