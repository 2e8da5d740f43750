"""The block pool's registered blocks as hash chains, the shape the KV index resync sends
(a worker re-announcing what it holds after the index restarted)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.block_hash import ROOT_HASH


def hash_chains(by_hash: Mapping[int, int], parent_hash: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Chains (parent_hash, [hashes in prefix order]) covering every registered block once
    (`by_hash`: block hash -> block; `parent_hash`: each block's parent's hash). A chain
    continues while its last block has exactly one registered child; it starts at the root
    or at a parent that is no longer registered, or where a chain branches."""
    children: dict[int, list[int]] = {}
    for value, block in by_hash.items():
        children.setdefault(parent_hash[block], []).append(value)
    chains: list[tuple[int, list[int]]] = []
    starts = [(parent, value) for parent, values in children.items()
              if parent == ROOT_HASH or parent not in by_hash for value in values]
    while starts:
        parent, value = starts.pop()
        chain = [value]
        while len(kids := children.get(chain[-1], [])) == 1:
            chain.append(kids[0])
        starts.extend((chain[-1], kid) for kid in children.get(chain[-1], []))
        chains.append((parent, chain))
    return chains
