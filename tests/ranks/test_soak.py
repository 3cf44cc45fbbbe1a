"""`megatron-hetero bench soak` in short: 60 steps at world 8 of the heterogeneous colocated layout and the
disjoint one (fork launcher, gloo, tiny model). After step 20 every rank's resident memory grows by less
than 2% and its process groups, threads and open descriptors stay the same; the figures are also checked
against what a rank of such a job must hold."""

from __future__ import annotations

import json

import pytest

from megatron_hetero.bench import soak


@pytest.mark.timeout(600)
def test_soak_60_steps_world_8(tmp_path, megatron_compat):
    doc = soak.run(tmp_path, steps=60, warmup=20)
    assert json.loads((tmp_path / "soak.json").read_text())["passed"] == doc["passed"]
    assert set(doc["layouts"]) == set(soak.LAYOUTS)
    for name, lay in doc["layouts"].items():
        assert lay["world"] == 8 and len(lay["ranks"]) == 8
        assert lay["last_loss"] < lay["first_loss"], name  # it trained
        for r in lay["ranks"]:
            assert list(r["samples"]) == ["1", "20", "28", "36", "44", "52", "60"]
            warm, end = r["samples"]["20"], r["samples"]["60"]
            assert 0 <= r["rss_growth"] < soak.MAX_RSS_GROWTH, (name, r["rank"], r["rss_growth"])
            assert r["rss_growth"] == pytest.approx((end["rss_bytes"] - warm["rss_bytes"]) / warm["rss_bytes"])
            for key in ("process_groups", "threads", "python_threads"):
                assert [s[key] for s in r["samples"].values()][1:] == [warm[key]] * 6, (name, r["rank"], key)
            # no descriptor kind grows (one closed, as seen once on a loaded CI machine, is not a leak)
            for s in list(r["samples"].values())[1:]:
                assert s["open_fds"] <= warm["open_fds"], (name, r["rank"], s["fds_by_kind"], warm["fds_by_kind"])
                assert all(n <= warm["fds_by_kind"].get(k, 0) for k, n in s["fds_by_kind"].items()), (name, r["rank"])
            # a rank holds the world group and its own groups; gloo talks over sockets; torch's pools run threads
            assert warm["process_groups"] >= 8 and warm["fds_by_kind"].get("socket", 0) >= 7
            assert warm["threads"] > warm["python_threads"] >= 1
            assert 100 * 2**20 < warm["rss_bytes"] < 4 * 2**30
    assert doc["passed"]
    # the table shows every rank of both layouts and the verdicts
    text = soak.table(doc)
    assert text.count("PASS") == 2 and text.count("| 7 |") == 2
