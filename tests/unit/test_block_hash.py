"""The shared block hashes: pinned values, and the incremental chain agreeing with the whole one."""

from __future__ import annotations

from common.block_hash import (ROOT_HASH, block_hash, chain_hashes, extend_chain, parent_of, partial_block_hash,
                               prompt_hashes, salted_key)

TOKENS = list(range(10))


def test_hash_values_are_pinned() -> None:
    # Workers, the index and stored snapshots must agree across versions.
    assert block_hash(ROOT_HASH, [1, 2, 3]) == 44643602327473170
    assert chain_hashes(TOKENS, 4, "m") == [8151903867957196413, 7301574251545088063]
    hashes = prompt_hashes(TOKENS, 4, "m")
    assert hashes.block_hashes == (8151903867957196413, 7301574251545088063)
    assert (hashes.partial_hash, hashes.partial_tokens) == (6732824221534243284, 2)


def test_extend_chain_hashes_each_new_full_block_once_in_place() -> None:
    hashes: list[int] = []
    for length in range(len(TOKENS) + 1):
        assert extend_chain(hashes, TOKENS[:length], 4, "m") is hashes
        assert hashes == chain_hashes(TOKENS[:length], 4, "m")


def test_chain_from_a_parent_continues_the_chain() -> None:
    whole = chain_hashes(TOKENS, 2, "m")
    assert chain_hashes(TOKENS[4:], 2, "m", parent=whole[1]) == whole[2:]


def test_partial_block_hash_chains_to_the_last_full_block() -> None:
    blocks = chain_hashes(TOKENS, 4, "m")
    assert parent_of(blocks, 0) == ROOT_HASH and parent_of(blocks, 2) == blocks[1]
    assert partial_block_hash(blocks[1], TOKENS[8:], "m") == prompt_hashes(TOKENS, 4, "m").partial_hash
    assert partial_block_hash(blocks[1], [], "m") == 0
    assert prompt_hashes(TOKENS[:8], 4, "m").partial_hash == 0


def test_an_empty_salt_is_the_model_key_and_hashes_as_before() -> None:
    assert salted_key("m") == salted_key("m", "") == "m"
    assert prompt_hashes(TOKENS, 4, salted_key("m", "")).block_hashes == (8151903867957196413, 7301574251545088063)


def test_salted_hash_values_are_pinned() -> None:
    hashes = prompt_hashes(TOKENS, 4, salted_key("m", "tenant-a"))
    assert hashes.block_hashes == (2813702669151770439, 1654035630208749913)
    assert hashes.partial_hash == 6756722277309509346


def test_different_salts_share_no_hash_not_even_the_first_block() -> None:
    keys = [salted_key("m", salt) for salt in ("", "a", "b", "tenant-a", "tenant-b")]
    assert len(set(keys)) == len(keys)
    seen: set[int] = set()
    for key in keys:
        hashes = prompt_hashes(TOKENS, 4, key)
        values = {*hashes.block_hashes, hashes.partial_hash}
        assert not values & seen
        seen |= values
    # The root is every salt's: only the hashes chained to it differ.
    assert parent_of(chain_hashes(TOKENS, 4, keys[1]), 0) == ROOT_HASH


def test_a_salt_never_reads_as_tokens_after_the_model_key() -> None:
    # Whatever the salt, its suffix is not a whole number of 4-byte tokens.
    for salt in ("x", "\x01\x00\x00", "a" * 100):
        assert (len(salted_key("m", salt).encode()) - len(b"m")) % 4 != 0


def test_the_packed_chain_gives_each_blocks_own_hash() -> None:
    """The chain packs its blocks' tokens at once: the same values as hashing block by block,
    whatever holds the tokens (list, tuple, numpy), up to the largest int32 id."""
    import numpy as np

    tokens = [0, 1, 2**31 - 1, 262143, 7, 99, 5, 2**20, 3, 4, 11]
    expected, parent = [], ROOT_HASH
    for start in range(0, 8, 4):
        parent = block_hash(parent, tokens[start:start + 4], "m")
        expected.append(parent)
    for held in (tokens, tuple(tokens), np.array(tokens, dtype=np.int64)):
        assert chain_hashes(held, 4, "m") == expected
        assert extend_chain(expected[:1], held, 4, "m") == expected


def test_tokens_pack_as_little_endian_int32_on_either_byte_order(monkeypatch) -> None:
    """The chain packs with the standard library's array (no numpy in the light services): its
    bytes are little-endian int32 whatever the host's order (a big-endian host swaps them)."""
    import struct
    import sys

    from common import block_hash as module

    tokens = [1, 2**31 - 1, 262143, 0]
    assert module._int32_bytes(tokens) == struct.pack("<4i", *tokens)
    monkeypatch.setattr(module.sys, "byteorder", "big" if sys.byteorder == "little" else "little")
    assert module._int32_bytes(tokens) == struct.pack(">4i", *tokens)
