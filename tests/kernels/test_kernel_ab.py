"""benchmarks/kernel_ab.py, run as its users run it: builds from source folders, times them side by
side and says whether each build's output is the first's bit for bit."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keyfold.kernels import native

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "kernel_ab.py"
KERNELS = ROOT / "keyfold" / "kernels"

pytestmark = pytest.mark.skipif(not native.prefill_available(torch.float32),
                                reason=f"the prefill kernel needs AVX-512 or AVX2 and a native build ({native.why()})")


#: timing at a tiny size
TINY = ("--n", "256", "--heads", "2", "--rounds", "2", "--no-gemm", "--dtype", "float32")


def _run(*args: str, cache: Path) -> subprocess.CompletedProcess:
    """The tool with ``args``, its builds in ``cache`` (not the user's build cache)"""
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "KEYFOLD_CACHE": str(cache)})


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One build cache for the module: the tests build the same sources (today's kernel, and a copy
    with the same changed coefficient), each build 5-10 s of a 2-core machine"""
    return tmp_path_factory.mktemp("kernel-ab-builds")


def _copy(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    for f in ("decode.c", "decode_avx2.c", "decode_merge.h", "prefill.c", "simd.h"):
        shutil.copy(KERNELS / f, d / f)
    return d


def test_a_copy_is_bit_for_bit_and_a_changed_kernel_is_not(tmp_path, cache):
    same = _copy(tmp_path, "same")
    changed = _copy(tmp_path, "changed")
    src = (changed / "prefill.c").read_text()
    coef = "1.8671966390684247e-3f"  # float32's 2^x, its degree-5 coefficient
    assert src.count(coef) == 1
    (changed / "prefill.c").write_text(src.replace(coef, "1.8671966390684247e-1f"))
    res = _run(f"now={KERNELS}", f"same={same}", f"changed={changed}", *TINY, cache=cache)
    assert res.returncode == 0, res.stderr
    lines = {ln.split(":")[0].strip(): ln for ln in res.stdout.splitlines() if ":" in ln}
    assert "x1.000 of now's time, output bit for bit now's" in lines["now"]
    assert "output bit for bit now's" in lines["same"]
    assert "output NOT bit for bit now's" in lines["changed"]


def test_the_fuzz_finds_no_difference_in_a_copy_and_finds_a_changed_coefficient(tmp_path, cache):
    same = _copy(tmp_path, "same")
    changed = _copy(tmp_path, "changed")
    src = (changed / "prefill.c").read_text()
    (changed / "prefill.c").write_text(src.replace("1.8671966390684247e-3f", "1.8671966390684247e-1f"))
    res = _run(f"now={KERNELS}", f"same={same}", f"changed={changed}", "--fuzz", "8", cache=cache)
    assert res.returncode == 0, res.stderr
    lines = {ln.split(":")[0].strip(): ln for ln in res.stdout.splitlines() if "not bit for bit" in ln}
    assert "same: 0 of 8" in lines["same"]
    changed_count = int(lines["changed"].split(":")[1].split()[0])
    assert changed_count > 0


def test_a_folder_without_the_sources_is_named(tmp_path, cache):
    res = _run(f"now={KERNELS}", f"empty={tmp_path}", *TINY, cache=cache)
    assert res.returncode != 0
    assert "builds: empty lacks" in res.stderr and "prefill.c" in res.stderr


def test_a_build_that_is_not_name_equals_folder_is_refused(cache):
    res = _run(str(KERNELS), *TINY, cache=cache)
    assert res.returncode != 0
    assert "is not name=folder" in res.stderr
