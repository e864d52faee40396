"""The kernel benchmark harness runs end to end at tiny sizes (it must not rot); no timing is asserted."""

import json

from keyfold.bench import kernels


def test_harness_runs_and_writes_results(tmp_path):
    assert kernels.main(["--preset", "tiny", "--out", str(tmp_path), "--no-memory"]) == 0
    data = json.loads((tmp_path / "kernels.json").read_text())
    names = {r["case"]["variant"] for r in data["results"]}
    assert names == {v.name for v in kernels.VARIANTS}
    for r in data["results"]:
        assert r["times"]["keyfold"] > 0
        assert 0 < r["density"] <= 1
        if kernels.BY_NAME[r["case"]["variant"]].sdpa != "none":
            assert r["times"]["sdpa"] > 0 and r["ratio_sdpa"] > 0
    assert (tmp_path / "kernels.md").read_text().count("\n| ") >= len(names) + 1
    assert (tmp_path / "kernels.png").stat().st_size > 1000


def test_needed_work_is_counted_from_the_mask():
    r = kernels.run_case(kernels.Case("causal", 128, 16, "float32", "fwd", H=1), repeats=1, with_flex=False)
    assert abs(r.gflop - 4 * 16 * (128 * 129 / 2) / 1e9) < 1e-9
