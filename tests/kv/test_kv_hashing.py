"""Unit tests for the prefix cache's chained block hashes (kvserve/kv/hashing.py): one hash per full
block, chained so that a block's hash names its whole prefix, salted per tenant, the same whether the
blocks are hashed at once or as the sequence grows."""

from __future__ import annotations

import hashlib
from array import array

from kvserve.kv.hashing import ROOT_HASH, extend_block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert extend_block_hashes([], list(range(7)), block_size=4) != []
    assert len(extend_block_hashes([], list(range(7)), block_size=4)) == 1
    assert len(extend_block_hashes([], list(range(8)), block_size=4)) == 2
    assert extend_block_hashes([], [1, 2, 3], block_size=4) == []


def test_the_first_block_hashes_from_the_root_with_sha256():
    expected = hashlib.sha256(ROOT_HASH + array("q", [5, 6]).tobytes()).digest()
    assert extend_block_hashes([], [5, 6], block_size=2) == [expected]


def test_a_block_hash_names_its_whole_prefix():
    """Two sequences whose second blocks hold the same tokens after different first blocks get
    different second hashes: a hit on block i means blocks 0..i all match."""
    a = extend_block_hashes([], [1, 2, 3, 4], block_size=2)
    b = extend_block_hashes([], [9, 2, 3, 4], block_size=2)
    assert a[0] != b[0] and a[1] != b[1]
    c = extend_block_hashes([], [1, 2, 3, 4, 5, 6], block_size=2)
    assert c[:2] == a  # a shared prefix shares its hashes


def test_growing_a_sequence_hashes_only_the_new_blocks_and_agrees_with_one_pass():
    tokens = list(range(100, 120))
    hashes: list[bytes] = []
    for end in [*range(0, len(tokens), 3), len(tokens)]:
        before = list(hashes)
        extend_block_hashes(hashes, tokens[:end], block_size=4)
        assert hashes[: len(before)] == before  # earlier hashes are never recomputed differently
    assert hashes == extend_block_hashes([], tokens, block_size=4)


def test_the_cache_salt_changes_every_block_and_only_the_salt_does():
    tokens = list(range(12))
    plain = extend_block_hashes([], tokens, block_size=4)
    salted = extend_block_hashes([], tokens, block_size=4, cache_salt="tenant-a")
    other = extend_block_hashes([], tokens, block_size=4, cache_salt="tenant-b")
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert all(s != o for s, o in zip(salted, other, strict=True))
    assert salted == extend_block_hashes([], tokens, block_size=4, cache_salt="tenant-a")


def test_token_ids_are_encoded_without_ambiguity():
    """Each id takes 8 bytes: [1, 256] and [256, 1] differ, and so do ids past 2**32."""
    assert hash_block(ROOT_HASH, [1, 256]) != hash_block(ROOT_HASH, [256, 1])
    assert hash_block(ROOT_HASH, [2**32 + 1]) != hash_block(ROOT_HASH, [1])
    assert hash_block(ROOT_HASH, [1, 2], ()) == hash_block(ROOT_HASH, (1, 2))
    assert hash_block(ROOT_HASH, [1, 2], (("k", "v"),)) != hash_block(ROOT_HASH, [1, 2])
