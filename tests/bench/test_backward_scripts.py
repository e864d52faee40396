"""benchmarks/small_calls.py, backward_kernel.py and backward_tiles.py, run as the README prints them but at tiny shapes:
they time keyfold beside its peer on the same work and write their tables."""

import subprocess
import sys
from pathlib import Path

import pytest

from keyfold.kernels import native

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "small_calls.py"
KERNEL = ROOT / "benchmarks" / "backward_kernel.py"
TILES = ROOT / "benchmarks" / "backward_tiles.py"


def test_small_calls_times_both_and_writes_its_table(tmp_path):
    code = (f"import sys; sys.argv = ['small_calls.py', '--out', {str(tmp_path)!r}]\n"
            f"import runpy; g = runpy.run_path({str(TOOL)!r})\n"
            "g['SHAPES'][:] = [(1, 2, 16, 8)]\n"
            "a, b = g['measure'](1, 2, 16, 8, repeats=1)\n"
            "assert a > 0 and b > 0, (a, b)\n"
            "g['main']()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    table = (tmp_path / "small-calls.md").read_text()
    assert "Machine:" in table and "| 1 | 2 | 16 | 8 |" in table


@pytest.mark.skipif(not native.backward_available(), reason=f"native backward kernel: {native.why()}")
def test_backward_kernel_times_the_kernel_beside_the_op_and_writes_its_table(tmp_path):
    res = subprocess.run([sys.executable, str(KERNEL), "--quick", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line for line in (tmp_path / "backward-kernel.md").read_text().splitlines() if line.startswith("| 256 ")]
    assert len(rows) == 2 and all(float(r.split("|")[4]) > 0 for r in rows)  # causal and none, op ms > 0


def test_backward_tiles_times_keyfold_beside_sdpa_and_writes_its_tables(tmp_path):
    import json
    res = subprocess.run([sys.executable, str(TILES), "--sizes", "256", "--repeat", "1", "--out", str(tmp_path),
                          "--name", "bt"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads((tmp_path / "bt.json").read_text())
    assert data["machine"]["cpu"] and {r["variant"] for r in data["rows"]} == {"dense", "causal", "window256"}
    assert all(r["keyfold_bwd_s"] > 0 and r["sdpa_bwd_s"] > 0 and r["tiles_bwd_s"] > 0 and r["sdpa_peak_mib"] > 0
               for r in data["rows"])
    assert data["machine"]["dtype"] == "float32"
    table = (tmp_path / "bt.md").read_text()
    assert "Machine:" in table and "| 256 | causal |" in table
