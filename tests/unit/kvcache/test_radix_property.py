"""The radix index against a naive reference: for each worker, the set of
block prefixes (paths) it holds. Paths are tuples of one-token blocks over a
tiny alphabet, so random operations share prefixes and split runs a lot."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.block_hash import chain_hashes
from services.kvcache.kv_types import BlockStored
from services.kvcache.radix_index import InconsistentEvent, RadixIndex

WORKERS = st.sampled_from(["w0", "w1", "w2"])
PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)

Path = tuple[int, ...]


def hashes_of(path: Path) -> list[int]:
    return chain_hashes(list(path), 1)


def hash_of(path: Path) -> int:
    return hashes_of(path)[-1]


def partial_of(path: Path) -> int:
    return 10_000 + hash_of(path) % 1_000_000


class ReferenceIndex:
    def __init__(self) -> None:
        self.held: dict[str, set[Path]] = {}
        self.partials: dict[str, set[int]] = {}

    def store(self, worker: str, path: Path, start: int, with_partial: bool) -> bool:
        """Stores path[start:] under path[:start]; False when inconsistent."""
        held = self.held.setdefault(worker, set())
        if start > 0 and path[:start] not in held:
            return False
        held.update(path[:end] for end in range(start + 1, len(path) + 1))
        if with_partial:
            self.partials.setdefault(worker, set()).add(partial_of(path))
        return True

    def match(self, path: Path) -> dict[str, int]:
        result = {}
        for worker, held in self.held.items():
            depth = 0
            while depth < len(path) and path[:depth + 1] in held:
                depth += 1
            if depth:
                result[worker] = depth
        return result

    def replace(self, worker: str, chains: list[tuple[Path, int]]) -> None:
        self.held[worker] = set()
        self.partials[worker] = set()
        remaining = list(chains)
        progress = True
        while progress:
            progress = False
            for item in list(remaining):
                path, start = item
                if start == 0 or path[:start] in self.held[worker]:
                    self.store(worker, path, start, False)
                    remaining.remove(item)
                    progress = True


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = RadixIndex()
        self.reference = ReferenceIndex()
        self.seen: set[Path] = set()

    @rule(worker=WORKERS, path=PATHS, start_fraction=st.floats(0, 1), with_partial=st.booleans())
    def store(self, worker: str, path: Path, start_fraction: float, with_partial: bool) -> None:
        start = min(int(start_fraction * len(path)), len(path) - 1)
        self.seen.add(path)
        parent = hash_of(path[:start]) if start else 0
        blocks = hashes_of(path)[start:]
        expected = self.reference.store(worker, path, start, with_partial)
        try:
            self.index.insert(worker, parent, blocks, partial_of(path) if with_partial else 0)
            stored = True
        except InconsistentEvent:
            stored = False
        assert stored == expected

    @rule(worker=WORKERS, paths=st.lists(PATHS, max_size=4), partial=st.booleans())
    def remove(self, worker: str, paths: list[Path], partial: bool) -> None:
        hashes = [hash_of(p) for p in paths]
        if partial:
            hashes += [partial_of(p) for p in paths]
        self.index.remove(worker, hashes)
        held = self.reference.held.get(worker, set())
        held.difference_update(paths)
        if partial:
            self.reference.partials.get(worker, set()).difference_update(
                partial_of(p) for p in paths)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), worker=WORKERS)
    def remove_seen_suffix(self, data: st.DataObject, worker: str) -> None:
        path = data.draw(st.sampled_from(sorted(self.seen)))
        cut = data.draw(st.integers(0, len(path) - 1))
        self.remove(worker, [path[:end] for end in range(cut + 1, len(path) + 1)], False)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), worker=WORKERS)
    def remove_scattered_blocks_of_a_path(self, data: st.DataObject, worker: str) -> None:
        path = data.draw(st.sampled_from(sorted(self.seen)))
        ends = data.draw(st.sets(st.integers(1, len(path))))
        self.remove(worker, [path[:end] for end in sorted(ends)], False)

    @rule(worker=WORKERS)
    def clear(self, worker: str) -> None:
        self.index.clear(worker)
        self.reference.held[worker] = set()
        self.reference.partials[worker] = set()

    @rule(worker=WORKERS, items=st.lists(st.tuples(PATHS, st.floats(0, 1)), max_size=4))
    def resync(self, worker: str, items: list[tuple[Path, float]]) -> None:
        chains = []
        for path, fraction in items:
            start = min(int(fraction * len(path)), len(path) - 1)
            chains.append((path, start))
            self.seen.add(path)
        snapshot = [BlockStored(hash_of(p[:s]) if s else 0, tuple(hashes_of(p)[s:]))
                    for p, s in chains]
        self.index.replace_worker(worker, snapshot)
        self.reference.replace(worker, chains)

    @invariant()
    def tree_is_well_formed(self) -> None:
        self.index.check_invariants()

    @invariant()
    def holdings_agree(self) -> None:
        for worker in ("w0", "w1", "w2"):
            expected = {hash_of(p) for p in self.reference.held.get(worker, set())}
            assert self.index.blocks_of(worker) == expected
            assert self.index.partials_of(worker) == self.reference.partials.get(worker, set())

    @invariant()
    def matches_agree(self) -> None:
        for path in self.seen:
            for cut in range(1, len(path) + 1):
                query = path[:cut] + (0, 1)
                assert self.index.match_prefix(hashes_of(query)) == self.reference.match(query)


RadixMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixAgainstReference = RadixMachine.TestCase
