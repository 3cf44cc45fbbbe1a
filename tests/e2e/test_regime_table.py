"""`megatron-hetero search --regime-table`: the whole 36-row table (every encoder x LLM x context preset
at cluster scale) through the CLI, on the default hardware preset. One table costs several seconds of
search, so it lives in this tier; the rows' agreement with the search on the 64-GPU rows is checked in
tests/pure/test_cost_search.py."""

from __future__ import annotations

import json

import pytest

from megatron_hetero import cli
from megatron_hetero.cli import search as cli_search
from megatron_hetero.planner import presets as PR


@pytest.mark.timeout(300)
def test_cli_regime_table_row_per_combination(capsys, monkeypatch) -> None:
    """`--regime-table --json` (the default preset): one row per combination, a placement picked or none
    fits, the gain over the best homogeneous layout consistent with the two step times; the markdown
    form prints the same rows, one table line each under the header."""
    assert cli.main(["search", "--regime-table", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(PR.ENCODER_PRESETS) * len(PR.LLM_PRESETS) * len(PR.REGIME_CONTEXTS) == 36
    assert {(r["encoder"], r["llm"], r["context"]) for r in rows} == {
        (e, m, c) for e in PR.ENCODER_PRESETS for m in PR.LLM_PRESETS for c in PR.REGIME_CONTEXTS
    }
    assert {r["gpus"] for r in rows} == {64, 256, 1024}
    for r in rows:
        # a row no placement fits says so (70B with a 6B or 12B encoder at 128K context: priced at the
        # bytes train's layers keep with the distributed optimizer, SP and selective recompute)
        assert r["picked"] in ("homogeneous", "colocated", "disjoint") or (
            r["picked"] is None and r["step_s"] is None and r["homogeneous_s"] is None
        ), r
        if r["gain"] is not None:
            assert r["gain"] >= -1e-12 and r["step_s"] == pytest.approx(r["homogeneous_s"] / (1 + r["gain"]))
    assert sum(r["picked"] is not None for r in rows) >= 30

    # the markdown form of the same table (the search is not run a second time)
    monkeypatch.setattr(cli_search, "regime_table", lambda *a, **k: rows)
    assert cli.main(["search", "--regime-table"]) == 0
    text = capsys.readouterr().out
    assert text.strip() == cli_search.regime_markdown(rows).strip()
    lines = text.strip().splitlines()
    assert lines[0].startswith("| encoder | LLM | context | GPUs") and len(lines) == 2 + 36
