"""Backend.TRITON on the CPU, in Triton's interpreter (TRITON_INTERPRET=1), by the rule of DESIGN.md §6.

The interpreter runs the very kernels a GPU runs, one program at a time in numpy, so shapes
stay tiny; its kernels use 16 x 16 tiles there, so every case below still has empty, partial
and full tiles. Under the interpreter tl.dot on bfloat16 gives garbage (DESIGN.md §7): float32
and float16 only. One subprocess test compiles the kernels for an H200 (sm_90) ahead of time.
"""

import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyfold as kf
from keyfold import Backend
from tests.helpers import assert_backward_by_rule, assert_forward_by_rule

# triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when keyfold.kernels.triton is
# imported: set it around that import (re-importing if something imported it without), then
# leave the environment of later test modules as it was.
_PREV = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
    import keyfold.kernels.triton as kt
    if type(kt._fwd_kernel).__name__ != "InterpretedFunction":  # re-decorate the kernels, then rebind
        importlib.reload(importlib.import_module("keyfold.kernels.triton.source"))
        kt = importlib.reload(kt)
except ImportError:
    kt = None
finally:
    if _PREV is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PREV
if kt is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

T = Backend.TRITON
N = 45  # 3 query tiles of 16, the last one ragged


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _qkv(dtype, B=1, Hq=2, Hkv=2, Nq=N, Nk=N, D=16, Dv=16):
    return (torch.randn(B, Hq, Nq, D, dtype=dtype), torch.randn(B, Hkv, Nk, D, dtype=dtype),
            torch.randn(B, Hkv, Nk, Dv, dtype=dtype))


def _docs(n=N):
    return (torch.arange(n) * 3 // n) * 1000 + 7  # 3 documents; large ids are renumbered


def _layout():
    g = torch.Generator().manual_seed(3)
    return torch.rand(2, 6, 6, generator=g) < 0.5  # per head, blocks of 8 (not the tile size)


PRESETS = {
    "dense": dict(),
    "causal": dict(mask=kf.causal()),
    "window": dict(mask=kf.causal() & kf.window(9)),
    "window_lr": dict(mask=kf.window(7, 5)),
    "sinks": dict(mask=kf.causal() & (kf.window(6) | kf.sinks(3))),
    "sinks_batch": dict(mask=kf.causal() & (kf.window(6) | kf.sinks(torch.tensor([2, 20])))),
    "prefix": dict(mask=kf.prefix(19)),
    "documents": dict(mask=kf.documents(_docs()) & kf.causal()),
    "block_sparse": dict(mask=kf.block_sparse(_layout(), 8)),
    "dilated": dict(mask=kf.dilated(3) & kf.causal()),
    "not_causal": dict(mask=~kf.causal()),                  # the last row sees nothing
    "empty_rows": dict(mask=kf.window(6) & ~kf.window(3)),  # the first rows see nothing
    "callable": dict(mask=lambda b, h, q, k: (q - k).abs() % 7 < 4),
    "callable_bh": dict(mask=lambda b, h, q, k: ((q - k + b) % (h + 2) == 0) | (k <= 2 * b)),
    "documents_batch": dict(mask=kf.documents(torch.stack([_docs(), torch.arange(N) // 20]))),
}
BATCHED = ("sinks_batch", "callable_bh", "documents_batch")


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_forward_backward(name):
    """Every preset, forward and backward, against the float64 reference (float32 and float16
    alternate across presets to keep the interpreter's time down)."""
    dtype = torch.float16 if list(PRESETS).index(name) % 2 else torch.float32
    B = 2 if name in BATCHED else 1
    q, k, v = _qkv(dtype, B=B)
    assert_forward_by_rule(q, k, v, backend=T, **PRESETS[name])
    assert_backward_by_rule(q, k, v, backend=T, **PRESETS[name])


@pytest.mark.parametrize("score,dtype", [("alibi", torch.float32), ("softcap", torch.float16),
                                         ("alibi_softcap", torch.float16), ("softcap_alibi", torch.float32)])
def test_scores_in_kernel(score, dtype):
    """ALiBi and softcap (and both, in either order) run inside the kernel, fwd and bwd."""
    a, s = kf.alibi(kf.alibi_slopes(4)), kf.softcap(2.5)
    mods = {"alibi": a, "softcap": s, "alibi_softcap": [a, s], "softcap_alibi": [s, a]}[score]
    q, k, v = _qkv(dtype, Hq=4, Hkv=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the tile kernel
        assert_forward_by_rule(q, k, v, backend=T, mask=kf.causal(), score=mods)
        assert_backward_by_rule(q, k, v, backend=T, mask=kf.causal(), score=mods)


def test_gqa_offsets_and_value_width():
    """GQA (4 query heads on 1 kv head), Nq != Nk, a key chunk at kv_offset, Dv != D, and q, v
    as strided views of (B, N, H, D) tensors."""
    _, k, _ = _qkv(torch.float32, B=2, Hq=4, Hkv=1, Nq=21, Nk=37, D=24, Dv=40)
    q = torch.randn(2, 21, 4, 24).transpose(1, 2)   # (B, H, N, D) view, not contiguous
    v = torch.randn(2, 37, 1, 40).transpose(1, 2)
    kw = dict(mask=kf.causal() & (kf.window(11) | kf.sinks(2)), kv_offset=5)
    assert_forward_by_rule(q, k, v, backend=T, **kw)
    assert_backward_by_rule(q, k, v, backend=T, **kw)


def test_lse_gradient_and_merge():
    """Two key chunks merged equal the whole; gradients through lse (dlse) match the reference."""
    q, k, v = _qkv(torch.float32, Nq=20, Nk=40)
    a = kf.attend(q, k[:, :, :23], v[:, :, :23], mask=kf.causal(), q_offset=20, backend=T)
    b = kf.attend(q, k[:, :, 23:], v[:, :, 23:], mask=kf.causal(), q_offset=20, kv_offset=23, backend=T)
    whole = kf.attend(q.double(), k.double(), v.double(), mask=kf.causal(), backend=Backend.REFERENCE)
    merged = kf.merge(a, b)
    assert (merged.out - whole.out).abs().max() < 1e-5
    assert (merged.lse - whole.lse).abs().max() < 1e-5

    g = torch.randn(q.shape[:3], dtype=torch.float64)
    grads = []
    for backend, dt in ((T, torch.float32), (Backend.REFERENCE, torch.float64)):
        x = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        st_ = kf.attend(*x, mask=kf.documents(_docs(40)), backend=backend)
        (st_.lse.nan_to_num(neginf=0.0) * g.to(dt)).sum().backward()
        grads.append([torch.zeros_like(t) if t.grad is None else t.grad for t in x])  # lse ignores v
    for got, ref in zip(*grads):
        assert (got.double() - ref.double()).abs().max() < 1e-5
    assert grads[0][0].abs().max() > 0.1  # the lse gradient reached dq


def test_attend_backward_piece_with_global_state():
    """attend_backward on one piece with the global (out, lse): summed over the two pieces it
    equals the gradient of the whole (docs/math.md §2)."""
    q, k, v = _qkv(torch.float32, Nq=32, Nk=32)
    whole = kf.attend(q, k, v, mask=kf.causal(), backend=Backend.REFERENCE)
    dout = torch.randn_like(whole.out)
    parts = [kf.attend_backward(q, k[:, :, s], v[:, :, s], whole.out, whole.lse, dout, mask=kf.causal(),
                                q_offset=0, kv_offset=s.start, backend=T)
             for s in (slice(0, 13), slice(13, 32))]
    x = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    kf.attend(*x, mask=kf.causal(), backend=Backend.REFERENCE).out.backward(dout.double())
    assert (parts[0][0] + parts[1][0] - x[0].grad).abs().max() < 1e-5
    assert (torch.cat([parts[0][1], parts[1][1]], 2) - x[1].grad).abs().max() < 1e-5
    assert (torch.cat([parts[0][2], parts[1][2]], 2) - x[2].grad).abs().max() < 1e-5


def test_fully_masked_rows_exact_zero():
    """Rows that see no key: out exactly 0, lse -inf, gradients 0, never NaN."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(torch.float32, Nq=20, Nk=20))
    st_ = kf.attend(q, k, v, mask=kf.causal(), q_offset=-8, backend=T)  # rows 0..7 precede every key
    assert bool((st_.out[:, :, :8] == 0).all()) and bool(st_.lse[:, :, :8].isneginf().all())
    assert bool(st_.lse[:, :, 8:].isfinite().all())
    st_.out.sum().backward()
    assert not torch.isnan(q.grad).any() and bool((q.grad[:, :, :8] == 0).all())
    nothing = kf.attend(q, k, v, mask=~kf.full(), backend=T)  # every tile empty: nothing runs
    assert bool((nothing.out == 0).all()) and bool(nothing.lse.isneginf().all())


# Random mask trees from the presets (&, |, ~): the in-kernel program (an OR of AND clauses)
# must agree with the mask's own meaning. Forward only, few examples: the interpreter is slow.
_LEAVES = st.sampled_from([kf.causal(), kf.window(5), kf.window(3, 4), kf.sinks(4), kf.prefix(9),
                           kf.documents(_docs(40)), kf.dilated(2), kf.block_sparse(_layout()[0], 8)])
_TREES = st.recursive(_LEAVES, lambda c: st.one_of(st.tuples(c, c).map(lambda t: t[0] & t[1]),
                                                   st.tuples(c, c).map(lambda t: t[0] | t[1]),
                                                   c.map(lambda m: ~m)), max_leaves=4)


@settings(max_examples=6)
@given(mask=_TREES, q_offset=st.integers(0, 12))
def test_mask_program_matches_mask(mask, q_offset):
    q, k, v = _qkv(torch.float32, Nq=24, Nk=36)
    assert_forward_by_rule(q, k, v, backend=T, mask=mask, q_offset=q_offset)


def test_mask_program_encoding():
    """The DNF compiler: prefix is sinks | causal; negation pushes down by De Morgan."""
    prog = kt._mask_program(kf.prefix(5) & ~(kf.window(3) | kf.dilated(2)))
    # (sinks | causal) & ~window & ~dilated  ->  2 clauses of 3 literals
    assert prog.nlit == 6 and prog.tile_mask is None
    codes = [(prog.code >> (8 * i)) & 255 for i in range(prog.nlit)]
    assert [c & 15 for c in codes] == [kt._Op.SINKS, kt._Op.WINDOW, kt._Op.DILATED,
                                       kt._Op.CAUSAL, kt._Op.WINDOW, kt._Op.DILATED]
    assert [bool(c & kt._NEGATE) for c in codes] == [False, True, True, False, True, True]
    assert [bool(c & kt._END) for c in codes] == [False, False, True, False, False, True]
    fn = kt._mask_program(kf.as_mask(lambda b, h, q, k: q >= k) & kf.causal())
    assert fn.tile_mask is not None  # callables are evaluated per partial tile


@pytest.mark.parametrize("case,match", [
    ("callable", "score_mod callable"), ("float64", "float64"), ("head_dim", "head_dim 288 > 256"),
    ("positions", "positions >= 2\\^30")])
def test_named_triton_raises_for_what_it_cannot_run(case, match):
    """Issue #17: a named backend runs the call or raises; it never hands it to another (the
    old code ran these on the tile kernel with a RuntimeWarning)."""
    q, k, v = _qkv(torch.float32, Nq=20, Nk=20)
    kw = {"mask": kf.causal()}
    if case == "callable":
        kw["score"] = lambda s, b, h, qi, ki: s * 0.5
    elif case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "head_dim":
        q, k, v = (torch.randn(1, 2, 20, 288) for _ in range(3))
    else:
        kw["q_offset"], kw["kv_offset"] = 1 << 30, 1 << 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(ValueError, match=match) as e:
            kf.attention(q, k, v, backend=T, **kw)
    assert "Backend.AUTO" in str(e.value) and "Backend.TILES" in str(e.value)


def test_auto_routes_to_tiles_what_triton_cannot_run(monkeypatch):
    """Where AUTO picks Triton (CUDA), a call the kernel cannot run goes to the tile kernel,
    silently and with the tile kernel's answer; a call it can run stays on Triton."""
    from keyfold import engine
    monkeypatch.setattr(engine, "_resolve", lambda backend, q, score, dropout_p=0.0: T)  # AUTO as on CUDA
    q, k, v = _qkv(torch.float32, Nq=20, Nk=20)
    fn = lambda s, b, h, qi, ki: s * 0.5  # noqa: E731
    call = engine._Call(q, k, v, kf.causal(), kf.as_score(fn), None, None, 0, Backend.AUTO, None, False)
    assert call.backend is Backend.TILES
    assert engine._Call(q, k, v, kf.causal(), None, None, None, 0, Backend.AUTO, None, False).backend is T
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kf.attention(q, k, v, score=fn, mask=kf.causal())
    ref = kf.attention(q, k, v, score=fn, mask=kf.causal(), backend=Backend.TILES)
    assert torch.equal(got, ref)


def test_availability_and_clear_errors(monkeypatch):
    assert kt.available()
    q = torch.randn(1, 1, 4, 8)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kf.attend(q, q, q, backend=T)
    with pytest.raises(ValueError, match="CUDA"):
        kt.check_supported(q.to("meta"), None)


_COMPILE = """
import torch, keyfold as kf, keyfold.kernels.triton as kt
mask = kf.causal() & kf.documents(torch.arange(256) // 50) & (kf.window(64) | kf.block_sparse(torch.ones(16, 16, dtype=torch.bool), 16))
r = kt.compile_for_gpu(90, "bf16", 128, mask=mask, kernels=("_fwd_kernel", "_bwd_dkdv_kernel"))
# programs that stage a per-pair table (a callable's tile bitmap, a block layout) through shared
# memory: at 128 x 128 tiles their forward needed 256 and 352 KiB on the H200 and did not launch
for m in (lambda b, h, q, k: (q - k) % 7 < 4, kf.block_sparse(torch.rand(4, 33, 33) < 0.4, 64)):
    r2 = kt.compile_for_gpu(90, "bf16", 128, mask=m, score=[], kernels=("_fwd_kernel", "_bwd_dq_kernel"))
    r["_fwd_kernel"]["shared_bytes"] = max(r["_fwd_kernel"]["shared_bytes"], *(x["shared_bytes"] for x in r2.values()))
print(sorted(r), max(v["shared_bytes"] for v in r.values()))
"""


def test_kernels_compile_for_h200(tmp_path):
    """Ahead-of-time compile (no GPU needed) for sm_90, bfloat16, head_dim 128, with a mask
    program of causal, documents, window and block_sparse literals and ALiBi + softcap: the
    forward and dK/dV kernels (dQ is the forward's loop with the dK/dV tile's algebra) lower to
    a cubin and fit the H200's 227 KiB of shared memory per block, compiled as an aligned launch
    is specialised; so do the forwards of a mask callable and of a block layout alone (on the
    H200 they raised OutOfResources before their tiles were narrowed)."""
    pytest.importorskip("triton.backends.nvidia.compiler")  # the CUDA backend (and its ptxas)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold compile, not a cache hit
    res = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
    assert res.returncode == 0, res.stderr[-3000:]
    names, shared = res.stdout.split("]")[0] + "]", int(res.stdout.split("]")[1])
    assert names == str(sorted(["_fwd_kernel", "_bwd_dkdv_kernel"]))
    assert 0 < shared <= 227 * 1024


def test_gpu_benchmark_dry_run(tmp_path):
    """`python -m keyfold bench gpu` end to end on tiny CPU shapes: it writes JSON, markdown and a PNG, and
    keyfold's output agrees with SDPA and FlexAttention in its own check."""
    import importlib
    import json
    bench = importlib.import_module("keyfold.bench.gpu")
    assert bench.visible_pairs("window1024", 3000, None) == sum(min(i, 1024) + 1 for i in range(3000))
    assert bench.main(["--dry-run", "--sizes", "32", "--variants", "causal,documents", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    assert (tmp_path / "gpu-dry-run.md").exists() and (tmp_path / "gpu-dry-run.png").stat().st_size > 1000
    timed = {(r["variant"], r["mode"]) for r in res["rows"] if r["method"] == "keyfold" and r["tflops"]}
    assert timed == {(v, m) for v in ("causal", "documents") for m in bench.MODES}
    diffs = [d for c in res["checks"].values() for d in c.values()]
    assert len(diffs) == 3 and all(isinstance(d, float) and d < 1e-5 for d in diffs), res["checks"]


def test_mask_tensors_must_fit_the_call():
    """The kernel reads per-head layouts and per-batch ids unchecked, so sizes are checked first."""
    q, k, v = _qkv(torch.float32, B=2, Hq=4, Nq=16, Nk=16)
    with pytest.raises(ValueError, match="layout has 2 heads but q has 4"):
        kf.attend(q, k, v, mask=kf.block_sparse(torch.ones(2, 2, 2, dtype=torch.bool), 8), backend=T)
    with pytest.raises(ValueError, match="3 rows of ids but the batch has 2"):
        kf.attend(q, k, v, mask=kf.documents(torch.zeros(3, 16, dtype=torch.long)), backend=T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled kernels)")
def test_compiled_kernels_on_cuda_by_the_rule():
    """Where a GPU exists: the real compiled kernels, bfloat16, N=2048, D=128, forward and
    backward for six masks, by the rule of DESIGN.md §6 (the script exits 1 on a miss)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)
    res = subprocess.run([sys.executable, "-m", "keyfold", "bench", "gpu", "--accuracy"], cwd=root,
                         env=dict(env, PYTHONPATH=root), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sum(line.endswith("| yes |") for line in res.stdout.splitlines()) == 6


def test_user_mask_class_runs_in_the_kernel():
    """A mask class defined outside keyfold (the protocol of issue #17) runs on Backend.TRITON:
    it has no spec(), so the kernel reads it as per-tile bitmaps; forward and backward by the rule,
    alone and combined with presets the kernel compiles itself."""
    from tests.core.test_protocol import DilatedWindow
    q, k, v = _qkv(torch.float32)
    for mask in (DilatedWindow(20, 3), DilatedWindow(20, 3) | kf.sinks(2), kf.causal() & ~DilatedWindow(8, 1)):
        assert_forward_by_rule(q, k, v, mask=mask, backend=T)
        assert_backward_by_rule(q, k, v, mask=mask, backend=T)


def test_wall_views_run_in_the_kernel():
    """The walls' mask view (keyfold.views: a striped ring piece with a head slice, a batch slice
    of a per-batch mask) has no spec(): the kernel reads it as tile bitmaps, by the rule."""
    from keyfold.views import MaskView, Remap
    q, k, v = _qkv(torch.float32, B=2)
    striped = MaskView(kf.causal() & kf.window(30) | kf.sinks(1), Remap(q=(3, 4), k=(1, 4), h0=1))
    batch = MaskView(kf.causal() & (kf.window(6) | kf.sinks(torch.tensor([2, 20, 5]))),
                     Remap(batch=(3, 1)), n_batch=2)
    for mask in (striped, batch):
        assert_forward_by_rule(q, k, v, mask=mask, q_offset=0, backend=T)
        assert_backward_by_rule(q, k, v, mask=mask, q_offset=0, backend=T)


@pytest.mark.parametrize("name", ["causal", "documents", "sinks", "block_sparse", "callable"])
def test_backward_kernels_with_their_own_tiles(name, monkeypatch):
    """dQ and dK/dV may tile differently (each plans at its own tile size, as the GPU tuner
    sets them): the gradients still meet the rule, mask-callable bitmaps included."""
    from keyfold.kernels.triton import launch
    monkeypatch.setitem(launch._CONFIG_OVERRIDE, "dq", launch._Config(32, 16, 4, 1))
    monkeypatch.setitem(launch._CONFIG_OVERRIDE, "dkdv", launch._Config(16, 32, 4, 1))
    kw = dict(mask=lambda b, h, q, k: (q - k).abs() % 5 < 3) if name == "callable" else PRESETS[name]
    q, k, v = _qkv(torch.float32, Hq=4, Hkv=2) if name != "block_sparse" else _qkv(torch.float32)
    assert_backward_by_rule(q, k, v, backend=T, **kw)


def test_gpu_tuner_and_accuracy_shards_in_the_interpreter(monkeypatch):
    """`bench gpu --tune`'s search, on tiny shapes in the interpreter: every candidate is timed
    and checked by the rule, the fastest passing pair is left in the launch override; and one
    shard of `--accuracy --all-cases` (the decode row: one query, GQA 8 on 1) meets the rule row by
    row. Shapes are the smallest that still run every kernel (the interpreter's time grows with
    the tiles it steps through)."""
    from keyfold.bench import gpu as bench
    from keyfold.kernels.triton import launch
    monkeypatch.setattr(launch, "_CONFIG_OVERRIDE", {})
    cands = (((16, 16, 4, 1), (32, 16, 4, 1)), ((16, 16, 4, 1), (16, 32, 4, 1)))
    lines = bench.tune_backward(N=16, B=1, H=1, D=16, echo=lambda line: None, device="cpu", dtype=torch.float32,
                                check_N=16, candidates=cands)
    rows = [line for line in lines if line.startswith("| dq") or line.startswith("| dkdv")]
    assert len(rows) == 4 and all(r.endswith("| yes |") for r in rows), rows
    assert tuple(vars(launch._CONFIG_OVERRIDE["dq"]).values()) in cands[0]
    assert tuple(vars(launch._CONFIG_OVERRIDE["dkdv"]).values()) in cands[1]
    launch._CONFIG_OVERRIDE.clear()
    echoed = []
    table, ok = bench.accuracy(False, (torch.float32,), extended=True, shard=(17, 21), echo=echoed.append)
    assert ok and echoed == table.splitlines()
    assert [r for r in echoed if r.startswith("| decode: 1 query, causal, GQA 8 on 1 | float32 | TRITON")]
