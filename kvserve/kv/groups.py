"""KV-cache groups: which layers share a block table, and what one block of the pool stores. Torch-free.

A model whose layers all attend to the whole context has one group: a block holds every layer's keys and
values for `block_size` positions, and a request holds one block per `block_size` tokens.

A hybrid model (Gemma 3: five sliding-window layers of window W for every global layer) splits its
layers into groups of equal size, each of one kind (docs/scheduling.md "Hybrid models"): with 3 global and
15 window layers, one full-attention group of 3 layers and five window groups of 3. A block of the
shared pool then holds `group_size` layers (one per slot), and each group has its own block table per
request. A window group's table keeps only the blocks that some future query can still see (the last W
keys); the blocks before them go back to the pool while the request runs, and their entries become the
null block (block 0, never handed out, never read). So a 32k-token request on Gemma 3 holds 2,048
blocks for its global group but only about W / block_size + 1 for each window group.

The layout is the same one the model runner allocates (`layer_slot` picks the layer's slot in a block)
and the planner prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.core.block_tables import NULL_BLOCK as NULL_BLOCK  # defined where the runner reads it


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table. `window`: keys a query sees (None: the whole context)."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return "full" if self.window is None else f"window{self.window}"

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """Index of the first block a query at position `num_computed` (or later) still reads."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // block_size


@dataclass(frozen=True)
class KVLayout:
    """The groups (full-attention groups first) and, per layer, its group and its slot in a block."""

    groups: tuple[KVGroup, ...]
    group_size: int  # layers per block (slots)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def layer_group(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for index, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = index
        return tuple(out)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                out[layer] = slot
        return tuple(out)

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens ever holds at once, over every group, when
        prompt chunks are at most `max_chunk` tokens: a window group holds the blocks of the window
        before its chunk and the chunk's own."""
        total = 0
        full = -(-num_tokens // block_size)
        for group in self.groups:
            if group.window is None:
                total += full
            else:
                span = group.window - 1 + min(max_chunk, num_tokens)
                total += min(full, -(-span // block_size) + 1)
        return total

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request holds between steps, once `num_tokens` tokens are computed and the window
        groups have returned what no later query reads (the engine's count after its next step)."""
        full = -(-num_tokens // block_size)
        total = 0
        for group in self.groups:
            first = group.first_needed_block(num_tokens, block_size)
            total += full - first
        return total


def single_layout(num_layers: int) -> KVLayout:
    return KVLayout((KVGroup(None, tuple(range(num_layers))),), num_layers)


def plan_layout(
    layer_windows: tuple[int | None, ...], max_model_len: int | None = None
) -> KVLayout:
    """Groups for these per-layer windows. Hybrid only where it can save memory: some layers attend to
    everything and the others share one window shorter than the longest context; otherwise (every layer
    full, several windows, every layer windowed) one group as before, which keeps every block."""
    num_layers = len(layer_windows)
    full = [i for i, w in enumerate(layer_windows) if w is None]
    windowed = [i for i, w in enumerate(layer_windows) if w is not None]
    windows = {layer_windows[i] for i in windowed}
    if not full or not windowed or len(windows) != 1:
        return single_layout(num_layers)
    (window,) = windows
    if max_model_len is not None and max_model_len <= window:
        return single_layout(num_layers)
    size = min(len(full), len(windowed))
    groups = [KVGroup(None, tuple(full[i : i + size])) for i in range(0, len(full), size)]
    groups += [
        KVGroup(window, tuple(windowed[i : i + size])) for i in range(0, len(windowed), size)
    ]
    return KVLayout(tuple(groups), size)
