"""The kernel benchmark harness runs end to end at tiny sizes (it must not rot); no timing is asserted."""

import json

import pytest

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
        # the GEMM beside keyfold, in its rounds: the `of matmul` column
        assert set(r["matmul_times"]) == {"mm64"} and r["matmul_gflops"] > 0 and r["of_matmul"] > 0
        assert 0 < r["best_times"]["keyfold"] <= r["times"]["keyfold"]  # the fastest of the same samples
    assert "| of matmul | of best roof |" in (tmp_path / "kernels.md").read_text()
    assert (tmp_path / "kernels.md").read_text().count("\n| ") >= len(names) + 1
    assert (tmp_path / "kernels.png").stat().st_size > 1000


def test_needed_work_is_counted_from_the_mask():
    r = kernels.run_case(kernels.Case("causal", 128, 16, "float32", "fwd", H=1), repeats=1, with_flex=False)
    assert abs(r.gflop - 4 * 16 * (128 * 129 / 2) / 1e9) < 1e-9


def test_of_matmul_compares_fastest_with_fastest_of_the_same_rounds():
    """A loaded minute that slows the GEMM's median (not keyfold's) must not lift keyfold's share:
    the column is keyfold's fastest sample against the GEMM's fastest, not median against median."""
    r = kernels.Result(kernels.Case("dense", 4096, 64, "float32", "fwd"), density=1.0, gflop=10.0)
    r.times, r.best_times = {"keyfold": 0.050}, {"keyfold": 0.040}  # median 200, best 250 GFLOP/s
    r.matmul_gflops = 400.0  # the fastest GEMM sample of those rounds
    assert abs(r.of_matmul() - 250 / 400) < 1e-12
    r.matmul_gflops = None
    assert r.of_matmul() is None


def test_roof_is_sampled_through_the_run_and_the_best_kept():
    calls = []
    rates = iter([150.0, 198.0, 120.0, 90.0, 95.0, 40.0])  # float32, then bfloat16, per sample

    def rate(dtype):
        calls.append(dtype)
        return next(rates)

    roof = kernels.Roof(["float32", "bfloat16"], every=3, rate=rate)
    for i in range(5):  # cases 0..4: samples before cases 0 and 3
        roof.maybe_sample(i)
    roof.sample()  # and at the end
    assert roof.samples == {"float32": [150.0, 120.0, 95.0], "bfloat16": [198.0, 90.0, 40.0]}
    assert roof.best == {"float32": 150.0, "bfloat16": 198.0}  # a slow sample never lowers the roof
    assert len(calls) == 6
    assert kernels.Roof([], rate=rate).best == {}


def test_matmul_fns_time_one_product_each_way():
    """The GEMMs of the roof: bfloat16 natively and through float32 (the casts timed too) give the
    same product of the same operands, into buffers of their own (nothing allocated per call); FLOPs
    2 n^3."""
    import torch

    from keyfold.bench.harness import matmul_fns

    fns = matmul_fns(torch.bfloat16, (32,))
    # the native bfloat16 GEMM only where a probe finds it within 4x of the cast (a CPU without
    # AVX-512-BF16 or AMX, such as an AVX2 AMD EPYC, runs it at a small fraction of that)
    assert "mm32 via float32" in fns and set(fns) <= {"mm32", "mm32 via float32"}
    assert all(flop == 2 * 32 ** 3 for _, flop in fns.values())
    wide = fns["mm32 via float32"][0]()
    assert wide.dtype == torch.bfloat16 and wide.shape == (32, 32) and wide.abs().max() > 1
    assert fns["mm32 via float32"][0]().data_ptr() == wide.data_ptr()
    if "mm32" in fns:
        native = fns["mm32"][0]()
        assert native.dtype == torch.bfloat16 and torch.allclose(native.float(), wide.float(), rtol=2e-2, atol=5e-2)
        assert fns["mm32"][0]().data_ptr() == native.data_ptr()
    assert set(matmul_fns(torch.float32, (16, 32))) == {"mm16", "mm32"}


def test_interleaved_runs_a_lead_before_each_of_the_others():
    """Every callable runs right after a GEMM (the bench's leads), each GEMM in turn: in a fixed
    cycle keyfold alone always ran after the round's GEMMs (their matrices in the cache), which
    cost it 5-10% at 1k. Every lead is timed in every round."""
    from keyfold.bench.harness import interleaved

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("kf", "sdpa", "g1", "g2", "g3")}
    t = interleaved(fns, repeats=6, warmup=0, lead=("g1", "g2", "g3"))
    assert sorted(t) == sorted(fns)
    after = {}
    for prev, name in zip(calls, calls[1:]):
        if name in ("kf", "sdpa"):
            assert prev.startswith("g"), calls
            after.setdefault(name, []).append(prev)
    assert sorted(after["kf"]) == sorted(after["sdpa"]) == ["g1", "g1", "g2", "g2", "g3", "g3"]
    assert all(calls.count(g) >= 6 for g in ("g1", "g2", "g3"))
    with pytest.raises(ValueError, match="lead"):
        interleaved(fns, repeats=1, lead=("gemm",))
