"""Chained block hashes for prefix caching (docs/scheduling.md).

hash(block i) = SHA-256(hash(block i-1), token ids of block i, extra keys). The extra keys of the first
block carry anything that changes the computed states for the whole sequence (a per-tenant cache salt), and
the chain carries them to every later block. SHA-256 rather than Python's `hash`: a collision would silently
serve another prompt's cache, and a tenant must not be able to craft one.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = b"kvserve-prefix-cache-v1"


def hash_block(
    parent_hash: bytes, token_ids: tuple[int, ...] | list[int], extra_keys: tuple = ()
) -> bytes:
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(repr(extra_keys).encode())
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: tuple[int, ...] | list[int],
    block_size: int,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Append the hashes of the full blocks of `token_ids` not yet in `hashes` (in place), and return it."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else ROOT_HASH
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt is not None else ()
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes
