"""The boundary benchmark runs end to end (tiny shape, one iteration) and its byte ratios hold:
direct mode moves exactly the minimum, the leader path more. Times are not asserted."""
from __future__ import annotations

import json

import pytest

from megatron_hetero.bench import boundary as bench


@pytest.mark.timeout(300)
def test_bench_boundary_smoke(tmp_path):
    doc = bench.run(tmp_path, batch=8, seq=16, hidden=8, iters=1)
    assert json.loads((tmp_path / "boundary.json").read_text()) == doc
    assert len(doc["cases"]) == len(bench.CASES)
    for row in doc["cases"]:
        assert row["time_s"] > 0 and row["plain_send_s"] > 0
        if row["mode"] == "direct":
            assert row["bytes_moved"] == row["min_bytes"], row
        else:
            assert row["bytes_moved"] > row["min_bytes"], row
    assert "| case | mode |" in bench.table(doc)
