from __future__ import annotations

import pytest

from common.block_hash import chain_hashes
from services.kvcache.kv_types import AllCleared, BlockRemoved, BlockStored
from services.kvcache.radix_index import InconsistentEvent, RadixIndex


def chain(*symbols: int) -> list[int]:
    """Chained hashes of a path of one-token blocks."""
    return chain_hashes(list(symbols), 1)


@pytest.fixture
def index() -> RadixIndex:
    return RadixIndex()


def test_empty_index_matches_nothing(index: RadixIndex) -> None:
    assert index.match_prefix(chain(1, 2, 3)) == {}
    assert index.num_nodes == 0


def test_insert_and_match_longest_prefix(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3, 4))
    assert index.num_nodes == 1
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 4}
    assert index.match_prefix(chain(1, 2, 9, 9)) == {"a": 2}
    assert index.match_prefix(chain(1, 2, 3, 4, 5, 6)) == {"a": 4}
    assert index.match_prefix(chain(7)) == {}
    index.check_invariants()


def test_insert_is_idempotent(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3))
    index.insert("a", 0, chain(1, 2, 3))
    assert index.num_nodes == 1
    assert index.blocks_by_worker() == {"a": 3}
    index.check_invariants()


def test_extending_a_chain_of_the_same_worker_keeps_one_node(index: RadixIndex) -> None:
    blocks = chain(1, 2, 3, 4, 5)
    index.insert("a", 0, blocks[:2])
    index.insert("a", blocks[1], blocks[2:])
    assert index.num_nodes == 1
    assert index.match_prefix(blocks) == {"a": 5}
    index.check_invariants()


def test_branch_in_the_middle_of_a_run_splits_the_node(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3, 4))
    index.insert("a", chain(1, 2)[-1], chain(1, 2, 7, 8)[2:])
    # [1,2] -> {[3,4], [7,8]}
    assert index.num_nodes == 3
    assert index.match_prefix(chain(1, 2, 7, 8)) == {"a": 4}
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 4}
    index.check_invariants()


def test_second_worker_on_a_shared_prefix_splits_by_holders(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3, 4))
    index.insert("b", 0, chain(1, 2))
    assert index.num_nodes == 2  # [1,2]{a,b} -> [3,4]{a}
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 4, "b": 2}
    index.insert("b", chain(1, 2)[-1], chain(1, 2, 3, 4)[2:])
    assert index.num_nodes == 1  # merged back: [1,2,3,4]{a,b}
    index.check_invariants()


def test_parent_in_the_middle_of_a_run(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3, 4, 5))
    index.insert("b", 0, chain(1, 2, 3))
    index.insert("b", chain(1, 2)[-1], chain(1, 2, 8)[2:])
    assert index.match_prefix(chain(1, 2, 8)) == {"a": 2, "b": 3}
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 4, "b": 3}
    index.check_invariants()


def test_remove_leaf_blocks_prunes_and_merges(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3, 4))
    index.insert("b", 0, chain(1, 2))
    index.insert("b", chain(1, 2)[-1], chain(1, 2, 5)[2:])
    assert index.num_nodes == 3
    index.remove("b", chain(1, 2, 5)[2:])
    assert index.num_nodes == 2
    index.remove("b", chain(1, 2))
    assert index.num_nodes == 1
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 4}
    assert index.blocks_by_worker() == {"a": 4}
    index.check_invariants()


def test_removing_an_inner_block_cuts_the_workers_prefix(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3, 4))
    index.remove("a", [chain(1, 2)[-1]])
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 1}
    # The deeper blocks are still held: storing the hole again restores the prefix.
    index.insert("a", chain(1)[-1], [chain(1, 2)[-1]])
    assert index.match_prefix(chain(1, 2, 3, 4)) == {"a": 4}
    assert index.num_nodes == 1
    index.check_invariants()


def test_removing_unknown_hashes_is_ignored(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2))
    index.remove("a", chain(5, 6))
    index.remove("b", chain(1, 2))
    assert index.match_prefix(chain(1, 2)) == {"a": 2}
    index.check_invariants()


def test_clear_forgets_only_that_worker(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3))
    index.insert("b", 0, chain(1, 2, 3))
    index.insert("b", 0, chain(4, 5), partial_hash=99)
    index.clear("b")
    assert index.match_prefix(chain(1, 2, 3)) == {"a": 3}
    assert index.match_prefix(chain(4, 5)) == {}
    assert index.partial_holders(99) == frozenset()
    assert index.blocks_by_worker() == {"a": 3}
    assert index.num_nodes == 1
    index.check_invariants()


def test_store_under_a_parent_the_worker_does_not_hold_is_inconsistent(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2))
    with pytest.raises(InconsistentEvent):
        index.insert("b", chain(1, 2)[-1], chain(1, 2, 3)[2:])
    with pytest.raises(InconsistentEvent):
        index.insert("a", 12345, [777])
    assert index.match_prefix(chain(1, 2, 3)) == {"a": 2}
    index.check_invariants()


def test_hash_placed_under_another_parent_is_inconsistent(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2))
    with pytest.raises(InconsistentEvent):
        index.insert("a", 0, [chain(1, 2)[-1]])
    index.check_invariants()


def test_partial_blocks(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2), partial_hash=500)
    index.insert("b", 0, [], partial_hash=600)
    assert index.partial_holders(500) == {"a"}
    assert index.partial_holders(600) == {"b"}
    index.remove("a", [500])
    assert index.partial_holders(500) == frozenset()
    assert index.match_prefix(chain(1, 2)) == {"a": 2}
    index.check_invariants()


def test_replace_worker_resyncs_from_chains_in_any_order(index: RadixIndex) -> None:
    index.insert("a", 0, chain(9, 9, 9))
    index.insert("b", 0, chain(1, 2))
    full = chain(1, 2, 3, 4)
    dropped = index.replace_worker("a", [
        BlockStored(full[1], tuple(full[2:])),          # child listed before its parent
        BlockStored(0, tuple(full[:2]), partial_hash=7),
        BlockStored(424242, (1001, 1002)),              # parent nobody holds: unreachable
    ])
    assert dropped == 1
    assert index.match_prefix(chain(9, 9, 9)) == {}
    assert index.match_prefix(full) == {"a": 4, "b": 2}
    assert index.partials_of("a") == {7}
    assert index.blocks_of("a") == set(full)
    index.check_invariants()


def test_apply_dispatches_events(index: RadixIndex) -> None:
    index.apply("a", BlockStored(0, tuple(chain(1, 2))))
    index.apply("a", BlockRemoved((chain(1, 2)[-1],)))
    assert index.match_prefix(chain(1, 2)) == {"a": 1}
    index.apply("a", AllCleared())
    assert index.num_nodes == 0 and index.num_blocks == 0
    index.check_invariants()


def test_match_stops_at_structural_nodes_without_holders(index: RadixIndex) -> None:
    index.insert("a", 0, chain(1, 2, 3))
    index.remove("a", chain(1))
    assert index.match_prefix(chain(1, 2, 3)) == {}
    assert index.num_nodes == 2  # [1]{} kept as the path to [2,3]{a}
    index.check_invariants()


def test_removing_scattered_blocks_of_one_run(index: RadixIndex) -> None:
    blocks = chain(1, 2, 3, 4, 5, 6, 7)
    index.insert("a", 0, blocks)
    index.insert("b", 0, blocks)
    index.remove("a", [blocks[1], blocks[3], blocks[4], blocks[6]])
    assert index.match_prefix(blocks) == {"a": 1, "b": 7}
    assert index.blocks_of("a") == {blocks[0], blocks[2], blocks[5]}
    index.check_invariants()
