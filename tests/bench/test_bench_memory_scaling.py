"""The memory and scaling benchmarks run end to end at tiny sizes and write their files; the
exponent fit is exact on synthetic power laws. No time or memory target is asserted (the machine
is shared), only that the measurement sees what the call must allocate."""

import json

import numpy as np
import pytest

from keyfold.bench import memory, scaling


def test_memory_bench_runs_measures_and_skips_what_would_not_fit(tmp_path):
    # window1024's SDPA needs a dense mask; with --max-gib tiny it must be skipped with an estimate
    assert memory.main(["--sizes", "2048", "--variants", "causal", "window1024", "--max-gib", "1e-6",
                        "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    rows = {(r["variant"], r["N"]): r for r in data["rows"]}
    causal, window = rows[("causal", 2048)], rows[("window1024", 2048)]
    # one forward+backward must at least write out, dq, dk, dv: 4 * N * D float32 (B = H = 1)
    floor = 4 * 2048 * 64 * 4
    assert causal["keyfold"]["extra"] >= floor, causal
    assert causal["sdpa"]["extra"] >= floor, causal
    assert window["keyfold"]["extra"] >= floor, window
    assert "would need about" in window["sdpa"]["skipped"]
    assert causal["blocks_visited"] == 36 and causal["blocks_total"] == 64  # 8x8 blocks of 256, lower triangle
    md = (tmp_path / "memory.md").read_text()
    assert "AVX" in md or "no AVX2" in md  # the instruction sets are named
    assert "threads" in md and "VmHWM" in md
    assert md.count("\n| causal | 2048 |") == 1 and md.count("\n| window1024 | 2048 |") == 1

    # --append keeps the rows already there and adds (or replaces) the new ones (window1024 with SDPA
    # skipped: one fresh process, not two)
    assert memory.main(["--sizes", "1024", "--variants", "window1024", "--max-gib", "1e-6", "--append",
                        "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "memory.json").read_text())
    assert [(r["variant"], r["N"]) for r in data["rows"]] == [("window1024", 1024), ("causal", 2048),
                                                               ("window1024", 2048)]
    assert len(data["commands"]) == 2
    assert (tmp_path / "memory.md").read_text().count("\n| window1024 | ") == 2


def test_memory_bench_rejects_an_unknown_variant(tmp_path):
    with pytest.raises(SystemExit, match="--variants"):
        memory.main(["--variants", "nope", "--out", str(tmp_path)])


def test_scaling_bench_runs_and_writes_its_files(tmp_path):
    assert scaling.main(["--sizes", "256", "512", "1024", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert {r["mask"] for r in data["rows"]} == set(scaling.MASKS)
    assert len(data["rows"]) == 3 * len(scaling.MASKS)
    for r in data["rows"]:
        assert r["seconds"] > 0 and 0 < r["blocks_visited"] <= r["blocks_total"]
    assert set(data["fits"]) == set(scaling.MASKS)
    # causal over 256 x 256 blocks: 1, 3, 10 visited at N = 256, 512, 1024
    assert [r["blocks_visited"] for r in data["rows"] if r["mask"] == "causal"] == [1, 3, 10]
    md = (tmp_path / "scaling.md").read_text()
    assert "Fitted exponent" in md and "threads" in md
    assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_visited_blocks_grow_like_the_mask_says():
    # the sparse masks visit O(N) blocks, causal O(N^2): exponents from the plans alone (no timing)
    ns = [4096, 8192, 16384, 32768]
    for name, expected in (("causal", 2.0), ("window1024", 1.0), ("documents1024", 1.0)):
        counts = []
        for n in ns:
            c = scaling.kf.plan(scaling.mask_for(name, n), n, n).counts()
            counts.append(c["full"] + c["partial"])
        assert abs(scaling.fit_exponent(ns, counts) - expected) < 0.1, (name, counts)


@pytest.mark.parametrize("p", [0.0, 1.0, 1.5, 2.0])
def test_fit_exponent_recovers_a_power_law(p):
    ns = np.array([1024 * 2 ** i for i in range(8)], dtype=float)
    assert scaling.fit_exponent(ns, 3e-7 * ns ** p) == pytest.approx(p, abs=1e-9)
    # symmetric multiplicative noise (x1.1 and /1.1 alternating) leaves the slope nearly unchanged
    noise = np.where(np.arange(8) % 2 == 0, 1.1, 1 / 1.1)
    assert scaling.fit_exponent(ns, 3e-7 * ns ** p * noise) == pytest.approx(p, abs=0.02)


def test_fit_exponent_is_least_squares_not_endpoints():
    # a kink: the endpoint slope is 1.5, the least-squares slope differs and is computed exactly
    ns, ts = [1, 2, 4, 8], [1, 2, 4, 22.627416997969522]  # 8**1.5 = 22.63
    x, y = np.log(ns), np.log(ts)
    expected = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert scaling.fit_exponent(ns, ts) == pytest.approx(expected, rel=1e-12)
    assert abs(expected - 1.5) > 0.04  # 1.45: not the endpoint slope


def test_fit_exponent_rejects_bad_input():
    with pytest.raises(ValueError, match="two or more"):
        scaling.fit_exponent([1024], [1.0])
    with pytest.raises(ValueError, match="positive"):
        scaling.fit_exponent([1024, 2048], [1.0, 0.0])
