"""Block tables across the scheduler-runner boundary: each step sends what changed in a request's
tables since the runner last saw them, and the runner keeps the tables those changes rebuild.
Torch-free.

A request has one block table per KV group (kv/groups.py), all of one length. While it runs, a
table changes in two ways only: blocks are appended at the end (a new block, proposer lookahead),
and a sliding-window group's leading entries become `NULL_BLOCK` as the window passes them (a run
from index 0 that only grows). Nothing else changes in place: a rejected proposal rolls back the
computed count, not the table, and preemption frees the whole table. So one step's change of one
request is exact as

- `offset`: the tables' length when the runner last saw them; the new blocks go there. 0 sends the
  tables whole, which the scheduler does when the runner holds none for the request (its first
  schedule, or its resumption after preemption, prefix-cache and sibling hits included);
- `new_block_ids`: per group, the blocks appended (usually none; one every `block_size` tokens);
- `num_released`: per group, the length of its leading run of null entries (empty: none anywhere).
"""

from __future__ import annotations

from collections.abc import Sequence

NULL_BLOCK = 0  # a hybrid pool's reserved block: the entry of a window block already returned

DROP, CHANGE = "drop", "change"  # the kinds of `BlockTables.apply_ops` operations

# (offset, new block ids per group, leading null entries per group or () for none anywhere)
TableChange = tuple[int, tuple[tuple[int, ...], ...], tuple[int, ...]]


class TableChangeError(RuntimeError):
    """A change that does not fit the tables it is applied to: the two sides disagree."""


class TableSender:
    """The scheduler's record of what the runner holds of each request's tables (their length and
    each group's leading null run), from which it computes a step's `TableChange`."""

    def __init__(self, windowed: Sequence[bool]) -> None:
        """`windowed[g]`: group g is a sliding-window group (only those hold null entries; block 0
        is an ordinary block of a model with one group)."""
        self.windowed = tuple(windowed)
        self._any_window = any(self.windowed)
        self._none_new = tuple(() for _ in self.windowed)
        self._sent: dict[str, tuple[int, tuple[int, ...]]] = {}

    def whole(self, request_id: str, tables: Sequence[Sequence[int]]) -> TableChange:
        """The tables whole (offset 0): the runner holds none for this request."""
        self._sent.pop(request_id, None)
        return self._change(request_id, tables, 0, (0,) * len(self.windowed))

    def change(self, request_id: str, tables: Sequence[Sequence[int]]) -> TableChange:
        """What changed since the last change sent for this request (whole if none was)."""
        sent = self._sent.get(request_id)
        if sent is None:
            return self.whole(request_id, tables)
        if not self._any_window and len(tables[0]) == sent[0]:
            return sent[0], self._none_new, ()  # most decode steps: nothing changed
        return self._change(request_id, tables, *sent)

    def _change(
        self,
        request_id: str,
        tables: Sequence[Sequence[int]],
        offset: int,
        released: tuple[int, ...],
    ) -> TableChange:
        num_blocks = len(tables[0])
        if num_blocks < offset:
            raise TableChangeError(
                f"{request_id}: its block table shrank from {offset} to {num_blocks} blocks while "
                "it ran; a table only grows at the end"
            )
        if num_blocks == offset:
            new = self._none_new
        else:
            new = tuple(tuple(table[offset:]) for table in tables)
        if self._any_window:
            now = []
            for windowed, table, start in zip(self.windowed, tables, released, strict=True):
                if windowed:
                    while start < num_blocks and table[start] == NULL_BLOCK:
                        start += 1
                now.append(start)
            released = tuple(now)
            self._sent[request_id] = (num_blocks, released)
            return offset, new, released if any(released) else ()
        self._sent[request_id] = (num_blocks, released)
        return offset, new, ()

    def forget(self, request_id: str) -> None:
        """The runner drops the request's tables (it finished or was preempted)."""
        self._sent.pop(request_id, None)


class BlockTables:
    """The runner's copy of each request's block tables (one list per KV group), rebuilt from the
    changes of each step; a change that does not fit raises `TableChangeError`."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self._tables: dict[str, list[list[int]]] = {}
        self._released: dict[str, list[int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def get(self, request_id: str) -> list[list[int]]:
        """The request's tables, the first group's first (the runner reads them; never mutate)."""
        return self._tables[request_id]

    def apply(
        self,
        request_id: str,
        offset: int,
        new_block_ids: Sequence[Sequence[int]],
        num_released: Sequence[int] = (),
    ) -> list[list[int]]:
        """Apply one `TableChange`; returns the request's tables after it."""
        if len(new_block_ids) != self.num_groups:
            raise TableChangeError(
                f"{request_id}: a change for {len(new_block_ids)} KV groups, the runner has "
                f"{self.num_groups}"
            )
        if offset == 0:
            tables = [list(ids) for ids in new_block_ids]
            released = [0] * self.num_groups
            self._tables[request_id] = tables
            self._released[request_id] = released
        else:
            tables = self._tables.get(request_id)
            if tables is None:
                raise TableChangeError(
                    f"{request_id}: a change at block {offset} of tables the runner does not hold"
                )
            released = self._released[request_id]
            for table, ids in zip(tables, new_block_ids, strict=True):
                if len(table) != offset:
                    raise TableChangeError(
                        f"{request_id}: a change at block {offset} of a table of {len(table)} blocks"
                    )
                if ids:
                    table.extend(ids)
        for group, count in enumerate(num_released):
            start = released[group]
            if count > start:
                tables[group][start:count] = [NULL_BLOCK] * (count - start)
                released[group] = count
        return tables

    def apply_chunk(self, chunk) -> list[list[int]]:
        """Apply a `ScheduledChunk`'s change (core/outputs.py); returns the request's tables."""
        tables = self._tables.get(chunk.request_id)
        if (
            tables is not None
            and not chunk.new_block_ids
            and not chunk.group_new_block_ids
            and not chunk.num_released_blocks
            and len(tables[0]) == chunk.block_offset
            and self.num_groups == 1
        ):
            return tables  # most decode steps of a model with one group: nothing changed
        return self.apply(
            chunk.request_id, chunk.block_offset, chunk.new_tables, chunk.num_released_blocks
        )

    def drop(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
        self._released.pop(request_id, None)

    def apply_ops(self, ops: Sequence[Sequence]) -> None:
        """Apply operations in order: (DROP, request id) or (CHANGE, request id, offset, new block
        ids per group, leading nulls per group); how rank 0 of a tensor-parallel runner forwards the
        scheduler's changes to the other ranks (lists, after JSON, as well as tuples)."""
        for op in ops:
            if op[0] == DROP:
                self.drop(op[1])
            elif op[0] == CHANGE:
                self.apply(op[1], op[2], op[3], op[4])
            else:
                raise TableChangeError(f"unknown block-table operation {op[0]!r}")
