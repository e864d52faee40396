"""benchmarks/small_calls.py, run as the README prints it but at one tiny shape: it times keyfold and
SDPA on the same causal forward+backward and writes its table."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "small_calls.py"


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
