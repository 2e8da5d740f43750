"""`make bench-prefix ARGS="--quick --ttft-only"`: the tiny model on the whole stack, untraced
for the TTFTs and traced for their stages;
the identical prompt is served from cache entirely, and the table of stages from the
services' spans adds up to each measured time to first token."""

from __future__ import annotations

import re

from benchmarks.prefix_cache_bench import STAGES, main


def test_quick_ttft_rows_and_their_stages(capsys) -> None:
    main(["--quick", "--ttft-only"])
    out = capsys.readouterr().out
    identical = re.search(r"\| TTFT, identical prompt \| [0-9.,]+ ms \(prompt ([0-9,]+) tokens, cached ([0-9,]+)\)", out)
    assert identical and identical.group(1) == identical.group(2)      # nothing recomputed
    names = (*STAGES, "sum of the stages", "TTFT measured by the client")
    rows = {cells[0]: [float(cell.replace(",", "")) for cell in cells[1:]]
            for cells in ([cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines())
            if cells and cells[0] in names}
    assert all(stage in rows for stage in STAGES)
    for total, ttft in zip(rows["sum of the stages"], rows["TTFT measured by the client"]):
        assert abs(total - ttft) <= 0.11      # one clock; each printed to 0.1 ms
    assert all(value > 0 for value in rows["worker forward"])
