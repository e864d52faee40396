"""keyfold's own CPU kernels, built on first use with the system C compiler: ``decode.c`` (a few query
rows over a long cache, any CPU with AVX-512) and ``prefill.c`` (a whole plan: bfloat16 on AMX tiles,
float32 on AVX-512 FMAs) and ``backward.c`` (the gradients of a piece). On a CPU with AVX2 but no AVX-512
(AMD Zen 1-3, Intel client cores) the decode kernel is built from ``decode_avx2.c`` (the same contract on
8-float vectors) and the prefill kernel's float32 path and the backward kernel from the same
``prefill.c`` and ``backward.c`` (their 16-lane vectors as two 8-lane halves, simd.h; the same
arithmetic lane by lane): :func:`available`, :func:`backward_available` and ``prefill_available(float32)``
are True there, bfloat16 prefill False (no AMX), :func:`isa` says which.

Decoding reads every cached key and value once for a few query rows, so its limit is the memory
bandwidth, not arithmetic. PyTorch's fused CPU op reaches that limit for a float32 cache but not
for a 16-bit one: it converts float16 element by element (12 GB/s against a 27 GB/s stream copy,
Intel Xeon with AMX, 2 threads, 128k keys), and bfloat16 without AMX runs at 3.5-4.4 GB/s (AMD EPYC).
``decode.c`` widens 16-bit keys and values in registers and reads each byte once, float32 arithmetic
throughout; a GQA group's query heads come in as rows of their key/value head, so the group reads its
keys once (the fused op's GQA path through ``cpu.py`` folds them the same way).

Used for pieces without mask or score whose few query rows (every head of a GQA group counted: at
most ``cpu.NATIVE_ROWS`` over a 16-bit cache, from ``cpu.NATIVE_F32_ROWS`` over a float32 one, and from
:data:`FEW_ROWS` up to ``cpu.NATIVE_FEW_ROWS`` over a cache of any dtype, an MQA step's eight heads for
one) read at least :data:`MIN_KEYS` keys: a decoding step over a cache, a split-KV chunk, a cascade's
shared prefix; and for float32 pieces of 2 to ``cpu.NATIVE_MASKED_ROWS`` rows with a mask tile (or an
additive score's), which :func:`run` adds to the scores. Everything else stays on the fused op.

``prefill.c`` runs every piece of a plan in one call (:func:`prefill_available` says for which dtype):
one online softmax per 32 query rows over the keys of all the pieces they are in, scores and ``P @ V``
on AMX tiles in bfloat16 (CPUs with AMX-BF16) or on AVX-512 or AVX2 FMAs in float32, the softmax in
float32 16-lane vectors (simd.h), 32 x 32 sub-blocks a mask hides skipped, a softcap computed in the tile. ``cpu.py`` routes
bfloat16 and float32 calls to it (:func:`prefill`); the pieces' mask tiles are the ones the fused op
would get.

Built once per source, compiler flags and CPU into ``$KEYFOLD_CACHE`` (else
``$XDG_CACHE_HOME/keyfold``, else ``~/.cache/keyfold``): the file's name carries their hash, so an
edit or another CPU builds anew, and a build is written under a temporary name and renamed, so
processes that build at once (spawned ranks) never load half a file. Where it cannot be built (no C
compiler, a CPU without AVX-512 or AVX2, ``KEYFOLD_NATIVE=0`` in the environment), :func:`available` is
False, :func:`why` says why, and decoding stays on PyTorch's op, with the same results to rounding.

>>> import torch
>>> from keyfold.kernels import native
>>> q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 4096, 64), torch.randn(1, 8, 4096, 64)
>>> if native.available():
...     out, lse = native.attend(q, k, v, 64 ** -0.5)  # (1, 8, 1, 64) float32, (1, 8, 1) float64
...     ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
...     torch.testing.assert_close(out, ref)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ._common import cpu_flags

__all__ = ["available", "why", "isa", "backward_available", "bf16_dot", "pays", "attend", "run", "prefill_available", "prefill",
           "backward_takes", "backward", "backward_sums", "backward_amx_available", "MAX_ROWS", "FEW_ROWS",
           "MIN_KEYS"]

#: The sources, compiled into one library, and the header of their SIMD helpers (every header beside the
#: sources, this one and decode_merge.h, shared with decode_avx2.c, is part of the build's hash).
SOURCES = tuple(Path(__file__).with_name(n) for n in ("decode.c", "prefill.c", "backward.c"))
HEADER = Path(__file__).with_name("simd.h")
#: What CPUs with AVX2, FMA and F16C but no AVX-512 build: the AVX2 decode kernel (it includes
#: decode_merge.h), the prefill kernel's float32 path and the backward kernel (prefill.c and backward.c
#: on simd.h's AVX2 vectors).
SOURCES_AVX2 = tuple(Path(__file__).with_name(n) for n in ("decode_avx2.c", "prefill.c", "backward.c"))
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
         "-fPIC", "-shared", "-fopenmp")

#: The most query rows (heads of a GQA group times tokens) a call may have: the kernel's limit.
#: Up to how many it *pays* against the fused op is the router's call (``cpu.NATIVE_ROWS``).
MAX_ROWS = 64
#: From how many rows a call takes the kernel's several-rows path (decode.c's FEW_ROWS): eight rows
#: meet each key in D/2 FMAs, where the one-row path pays a dot product and a reduction per row.
FEW_ROWS = 5
#: Keys a call must read for the kernel to pay its fixed cost (threads, scratch, the q copy).
MIN_KEYS = 256
#: The largest head size (q, k and v) the kernel takes.
MAX_HEAD = 256

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why: str | None = None  # None: not tried yet
#: Calls that ran on the decode kernel so far in this process (the decode bench reports which path ran).
calls = 0
#: Calls that ran on the prefill kernel so far in this process.
prefill_calls = 0
#: Calls :func:`backward` has made (tests check the CPU backend's float32 backward runs on it).
backward_calls = 0
#: Of those and of :func:`backward_sums`'s, the calls that ran on AMX tiles (:func:`backward_amx_available`).
backward_amx_calls = 0
_amx: bool | None = None  # the prefill kernel is built with AMX and the OS lets this process use it


def _cache_dir() -> Path:
    if os.environ.get("KEYFOLD_CACHE"):
        return Path(os.environ["KEYFOLD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "keyfold"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build() -> tuple[ctypes.CDLL | None, str]:
    """Load the kernel, compiling it first when this source, flags and CPU have no build yet."""
    if os.environ.get("KEYFOLD_NATIVE", "1") == "0":
        return None, "disabled by KEYFOLD_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"needs an x86-64 CPU with AVX-512 (this is {platform.machine()})"
    missing = {"avx512f", "avx512bw", "avx512vl"} - cpu_flags()
    if not missing:
        return _load(SOURCES)
    lacks = {"avx2", "fma", "f16c"} - cpu_flags()
    if lacks:
        return None, f"this CPU lacks {', '.join(sorted(missing | lacks))}"
    lib, said = _load(SOURCES_AVX2)
    return lib, (f"{said} (the AVX2 build: decode, float32 prefill and backward; this CPU lacks "
                 f"{', '.join(sorted(missing))})" if lib is not None else said)


def _load(sources: tuple[Path, ...]) -> tuple[ctypes.CDLL | None, str]:
    """Compile ``sources`` (decode.c or decode_avx2.c, prefill.c and backward.c) into the cache unless built
    already, load the library and declare its entry points. ``benchmarks/kernel_ab.py`` loads
    changed copies of the sources this way."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH; set CC to one"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {cc} does not run: {e}"
    # every header beside the sources (simd.h, decode_merge.h) is part of what they compile
    headers = sorted({h for f in sources for h in f.parent.glob("*.h")})
    key = hashlib.sha256("\0".join([*(f.read_text() for f in (*sources, *headers)), " ".join(FLAGS), version,
                                    " ".join(sorted(cpu_flags()))]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"native-{key}.so"
    if not path.exists():
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=path.parent)
            os.close(fd)
            res = subprocess.run([cc, *FLAGS, *map(str, sources), "-o", tmp], capture_output=True, text=True,
                                 timeout=120)
            if res.returncode != 0:
                return None, f"{cc} failed on {', '.join(f.name for f in sources)}: {res.stderr.strip()[-500:]}"
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would lock other users of a shared cache folder out
            os.replace(tmp, path)  # atomic: another process sees the whole file or none
            tmp = None
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"could not build into {path.parent}: {e}; set KEYFOLD_CACHE to a writable folder"
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"could not load {path}: {e}"
    P, LL, I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    lib.kf_decode.restype = I
    lib.kf_features.restype = I
    lib.kf_decode.argtypes = [P, P, ctypes.c_double, P, P, I, *[LL] * 6, P, LL, LL, LL, I, I, I, I, I, LL, I, I, P, P, I]
    if hasattr(lib, "kf_prefill"):  # benchmarks/kernel_ab.py may build without it
        lib.kf_prefill_init.restype = I
        lib.kf_prefill.restype = I
        lib.kf_prefill.argtypes = [P, P, P, I, *[LL] * 9, I, I, I, LL, LL, I, I, ctypes.c_float, ctypes.c_float, P, I,
                                   I, P, P, I, P]
    if any(f.name == "backward.c" for f in sources):  # benchmarks/kernel_ab.py builds the forward kernels alone
        lib.kf_backward.restype = I
        lib.kf_backward.argtypes = [*[P] * 10, I, I, LL, LL, LL, I, I, I, LL, LL, I, I, ctypes.c_float, I, I, I, P, P, P,
                                    P, I]
    return lib, f"built at {path}"


def available() -> bool:
    """Whether the kernel is built and loaded (the first call builds it: about a second)."""
    global _lib, _why
    if _why is None:
        with _lock:
            if _why is None:
                _lib, _why = _build()
    return _lib is not None


def why() -> str:
    """Where the kernel was built, or why it was not."""
    available()
    return _why or ""


def isa() -> str | None:
    """The instruction set of the kernels built here: ``"avx512"`` (decode, prefill and backward),
    ``"avx2"`` (``decode_avx2.c``'s decode kernel, float32 prefill and the backward kernel), or None where none is
    built."""
    if not available():
        return None
    return "avx2" if _lib.kf_features() & 8 else "avx512"


def backward_available() -> bool:
    """Whether the backward kernel (``backward.c``: AVX-512, or AVX2 where the CPU has no AVX-512) is built here."""
    return available() and hasattr(_lib, "kf_backward")


def bf16_dot() -> bool:
    """Whether the build dots bfloat16 keys with a bfloat16 q by ``vdpbf16ps`` (CPUs with
    AVX-512-BF16); without it bfloat16 keys are widened to float32 like float16 ones."""
    return available() and bool(_lib.kf_features() & 1)


def prefill_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the prefill kernel runs ``dtype`` here: bfloat16 needs a build with AMX-BF16
    (``-march=native`` on a CPU that has it) and the tile registers granted to this process by the
    OS; float32 needs AVX-512 (F, BW, DQ) or AVX2 (with FMA and F16C). Other dtypes: False."""
    global _amx
    if dtype is torch.float32:
        return available() and bool(_lib.kf_features() & 4)
    if dtype is not torch.bfloat16:
        return False
    if _amx is None:
        _amx = available() and bool(_lib.kf_features() & 2) and _lib.kf_prefill_init() == 0
    return _amx


def _reset() -> None:
    """Forget the build, so the next :func:`available` tries again (tests change the environment)."""
    global _lib, _why, _amx
    with _lock:
        _lib, _why, _amx = None, None, None


def pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, min_keys: int = MIN_KEYS) -> bool:
    """Whether the kernel can run ``attend(q, k, v)`` and pays its fixed cost: CPU tensors, keys and
    values of one supported dtype with contiguous rows, q ``(B, H, R, D)`` with ``R <= MAX_ROWS``
    over k ``(B, H, N, D)``, ``N >= min_keys`` (:data:`MIN_KEYS` unless the router says otherwise), head
    sizes up to :data:`MAX_HEAD`, and a kernel built. How many rows it beats the fused op at is the
    router's call (``cpu.NATIVE_ROWS``)."""
    return k.shape[2] >= min_keys and _takes(q, k, v) is None and available()


def _takes(q, k, v) -> str | None:
    """None when the kernel can run ``(q, k, v)``, else what it cannot take."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v must be 4-d (B, H, N, D); got {q.dim()}, {k.dim()}, {v.dim()} dims"
    if not (q.device.type == k.device.type == v.device.type == "cpu"):
        return f"CPU tensors only; got {q.device}, {k.device}, {v.device}"
    if q.dtype not in _DTYPES or k.dtype not in _DTYPES or v.dtype != k.dtype:
        return f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: float32, bfloat16 or float16, k and v alike"
    if q.shape[:2] != k.shape[:2] or v.shape[:3] != k.shape[:3] or q.shape[-1] != k.shape[-1]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    if q.shape[0] < 1 or q.shape[1] < 1 or q.shape[2] < 1:
        return f"q {tuple(q.shape)} has no rows (an empty batch, no heads or no query)"
    if q.shape[2] > MAX_ROWS or max(q.shape[-1], v.shape[-1]) > MAX_HEAD or k.shape[2] < 1:
        return (f"rows {q.shape[2]} (max {MAX_ROWS}), head sizes {q.shape[-1]}/{v.shape[-1]} (max {MAX_HEAD}), "
                f"keys {k.shape[2]} (min 1)")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        return "k and v rows must be contiguous (stride 1 in the last dim)"
    return None


def mask_takes(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`run` takes ``mask`` for ``q (B, H, R, D)`` over ``k (B, H, N, D)``: float32, 4-d,
    broadcasting to ``(B, H, R, N)`` with its key dim whole."""
    return (mask.dtype is torch.float32 and mask.dim() == 4 and mask.shape[-1] == k.shape[2]
            and all(m in (1, n) for m, n in zip(mask.shape[:3], (q.shape[0], q.shape[1], q.shape[2]))))


#: The most keys one chunk (work item) of the decode kernel holds over a float32 cache. A chunk's online
#: softmax sums its keys in one chain a row (P V block by block, l, the rescales); over 12k keys in one
#: chunk float32 broke the rule in 1 of 24 calls at head sizes 64-65 (2.6-3.1x the naive error; a
#: review), 0 of 48 in chunks of at most this many, whose states finish() merges. 16-bit caches keep
#: fewer, longer chunks: their naive error is 16-bit rounding, far above the chain's, and 1024-key
#: chunks took 1.07-1.19x the time of a decoding step over 32k-128k keys (more streams to prefetch).
CHUNK_KEYS = 1024


def _chunks(tasks: int, n: int, threads: int, dtype: torch.dtype = torch.float32) -> int:
    """Key chunks per (batch, head): over a float32 cache chunks of at most :data:`CHUNK_KEYS` keys;
    over a 16-bit one enough work items for every thread to get about four, chunks of at least 1024
    keys (the items run dynamically scheduled, so uneven counts balance)."""
    if dtype is torch.float32:
        return max(1, -(-n // CHUNK_KEYS))
    want = -(-4 * threads // tasks)
    return max(1, min(want, n // 1024))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of rows ``q (B, H, R, D)`` over every key of ``k (B, H, N, D)``,
    ``v (B, H, N, Dv)`` (see :func:`pays` for what is taken). A row sees every key, so none is empty;
    a NaN or +inf score makes its row NaN (out and lse), as in PyTorch's op, and a score of -inf (an
    infinite key) hides its key, as there; a row whose every score is -inf gets out 0 and lse -inf.
    out is float32, lse float64: the kernel's ``M + log L`` summed in double (decode_merge.h), so a
    caller merging this state with others weighs it without float32's rounding of lse.

    Raises RuntimeError when the kernel is not available or refuses the shapes."""
    if not available():
        raise RuntimeError(f"keyfold's native decode kernel is not available: {why()}")
    refused = _takes(q, k, v)
    if refused is not None:
        raise RuntimeError(f"native.attend: {refused}; use the fused op for these")
    return run(q, k, v, scale)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
        mask: torch.Tensor | None = None, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` without its checks, for a caller that has just asked :func:`pays` (the
    decoding step's router: the checks would run twice per step). ``mask``: an additive float32 mask
    that broadcasts to ``(B, H, R, N)`` (a piece's tile: -inf where a row does not see a key, a bias
    where it does; :func:`mask_takes` says which it takes), added to the scaled scores; a row that sees
    no key gets out 0 and lse -inf. ``exact``: scores summed in double from the exact products of
    the float32 values (q, k, scale and mask as given), the running max in double, the rest as
    without: a score carries no float32 rounding (decode.c's ``exact_scores`` says why that counts),
    for a state merged with others."""
    global calls
    B, H, R, D = q.shape
    N, Dv = k.shape[2], v.shape[-1]
    m, ms = None, (0, 0, 0)
    if mask is not None:
        m = mask.expand(B, H, R, N)
        if m.stride(-1) != 1:
            m = m.contiguous()
        ms = tuple(m.stride(i) if m.shape[i] > 1 else 0 for i in range(3))
    qs = q.to(torch.float32).contiguous()  # (B, H, R, D)
    # bfloat16 q over bfloat16 keys: the kernel also takes q as it is, for dot products in bfloat16
    # pairs summed in float32 (exact products: no widening of the keys)
    qb = q.contiguous() if q.dtype is torch.bfloat16 and k.dtype is torch.bfloat16 else None
    out = torch.empty(B, H, R, Dv, dtype=torch.float32)
    lse = torch.empty(B, H, R, dtype=torch.float64)  # see attend
    threads = torch.get_num_threads()
    rc = _lib.kf_decode(qs.data_ptr(), None if qb is None else qb.data_ptr(), scale, k.data_ptr(), v.data_ptr(), _DTYPES[k.dtype], *k.stride()[:3],
                        *v.stride()[:3], None if m is None else m.data_ptr(), *ms,
                        B, H, R, D, Dv, N, _chunks(B * H, N, threads, k.dtype), threads,
                        out.data_ptr(), lse.data_ptr(), int(exact))
    calls += 1
    if rc != 0:
        raise RuntimeError(f"keyfold's native decode kernel refused q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"v {tuple(v.shape)} (code {rc})")
    return out, lse


#: The most head size (q, k and v) the prefill kernel takes.
PREFILL_MAX_HEAD = 256
#: int64 columns of one piece in the array :func:`prefill` passes (``piece_t`` in prefill.c).
PIECE_COLS = 12


def prefill_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None) -> str | None:
    """None when :func:`prefill` can run these tensors (cast to ``dtype`` first, when given), else what
    it cannot take."""
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v must be 4-d (B, H, N, D); got {q.dim()}, {k.dim()}, {v.dim()} dims"
    if not (q.device.type == k.device.type == v.device.type == "cpu"):
        return f"CPU tensors only; got {q.device}, {k.device}, {v.device}"
    if not (q.dtype == k.dtype == v.dtype and (dtype or q.dtype) in (torch.bfloat16, torch.float32)):
        return f"q, k and v all bfloat16 or all float32; got {q.dtype}, {k.dtype}, {v.dtype}"
    B, Hq, _, D = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[-1] != D or Hq % k.shape[1]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    if (D % 2 and (dtype or q.dtype) is torch.bfloat16) or max(D, v.shape[-1]) > PREFILL_MAX_HEAD:
        return f"head sizes {D}/{v.shape[-1]}: both at most {PREFILL_MAX_HEAD}, q and k's even in bfloat16"
    if (dtype is None or k.dtype == dtype) and not 1 <= k.stride(2) <= 1 << 26:
        # as kf_prefill checks it (keys expanded along the sequence, stride 0: it returned -1 and the
        # call raised where SDPA runs; a helper's fuzz)
        return f"k's sequence stride {k.stride(2)}: from 1 to 2^26"
    return None


def piece_row(q0: int, q1: int, k0: int, k1: int, causal: bool, mask: torch.Tensor | None = None,
              shift: torch.Tensor | None = None) -> list[int]:
    """One piece as :func:`prefill` takes it: rows ``[q0, q1)`` see keys ``[k0, k1)``; ``causal``:
    row ``q0 + t`` sees keys ``k0 .. k0 + t``; ``mask`` a float32 additive ``(B|1, H|1, L|1, k1 - k0)``
    tile with contiguous keys (-inf hides a pair); ``shift`` a float32 ``(B|1, H|1, L)`` contiguous row
    term added to every score of the row. The tensors must outlive the call."""
    row = [q0, q1, k0, k1, int(causal)]
    if mask is not None:
        row += [mask.data_ptr(), *(mask.stride(i) if mask.shape[i] > 1 else 0 for i in range(3))]
    else:
        row += [0, 0, 0, 0]
    if shift is not None:
        row += [shift.data_ptr(), shift.stride(0) if shift.shape[0] > 1 else 0, shift.stride(1) if shift.shape[1] > 1 else 0]
    else:
        row += [0, 0, 0]
    return row


def _prefill_on(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                table: torch.Tensor, cap: float, out: torch.Tensor, lse: torch.Tensor,
                lse_lo: torch.Tensor | None = None) -> int:
    """kf_prefill of ``lib`` on tensors :func:`prefill` has checked (rows contiguous), the pieces as an
    int64 ``(n, PIECE_COLS)`` table, into ``out`` (B, Hq, L, Dv) and ``lse`` (B, Hq, L), and the low part
    of a float64 lse into ``lse_lo`` (float32, (B, Hq, L)) where given: its return code."""
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    return lib.kf_prefill(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(q.dtype is torch.bfloat16), *q.stride()[:3],
                          *k.stride()[:3], *v.stride()[:3], B, Hq, Hkv, L, S, D, Dv, scale, cap, table.data_ptr(),
                          len(table), int(out.dtype is torch.bfloat16), out.data_ptr(), lse.data_ptr(),
                          torch.get_num_threads(), None if lse_lo is None else lse_lo.data_ptr())


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pieces: list[list[int]],
            cap: float = 0.0, out_dtype: torch.dtype = torch.float32,
            wide_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of rows ``q (B, Hq, L, D)`` over ``k (B, Hkv, S, D)``, ``v (B, Hkv, S, Dv)``
    (all bfloat16 or all float32, ``Hq`` a multiple of ``Hkv``) through the pieces (rows of
    :func:`piece_row`), a softcap ``cap`` (0: none) on every score. out is ``out_dtype`` (bfloat16 for
    bfloat16 inputs, or float32), lse float32 (float64 with ``wide_lse``: the kernel's ``m + log l``
    summed in double, for a caller that merges the state); rows no piece shows a key are 0 and -inf.

    Raises RuntimeError when the kernel is not available here or refuses the arguments."""
    global prefill_calls
    refused = prefill_takes(q, k, v)
    if refused is not None:
        raise RuntimeError(f"native.prefill: {refused}; use the fused op for these")
    if not prefill_available(q.dtype):
        raise RuntimeError(f"keyfold's prefill kernel runs bfloat16 on a CPU with AMX-BF16 and float32 on one with "
                           f"AVX-512, in a native build; not {q.dtype} here: {why()}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    B, Hq, L, _ = q.shape
    Dv = v.shape[-1]
    table = torch.tensor(pieces, dtype=torch.int64).reshape(-1, PIECE_COLS)
    out = torch.empty(B, Hq, L, Dv, dtype=out_dtype)
    lse = torch.empty(B, Hq, L, dtype=torch.float32)
    if out_dtype is torch.bfloat16 and q.dtype is not torch.bfloat16:
        raise ValueError(f"native.prefill: out_dtype bfloat16 needs bfloat16 inputs (got {q.dtype}); pass float32")
    lo = torch.empty(B, Hq, L, dtype=torch.float32) if wide_lse else None
    rc = _prefill_on(_lib, q, k, v, scale, table, cap, out, lse, lo)
    prefill_calls += 1
    if rc != 0:
        raise RuntimeError(f"keyfold's prefill kernel refused q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"v {tuple(v.shape)}, {len(table)} pieces (code {rc})")
    if lo is not None:
        lse = lse.double() + lo  # -inf + 0 on empty rows, NaN stays NaN
    return out, lse


#: The dtypes the backward kernel reads (its code for each: backward.c's dt)
_BACKWARD_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: The largest head size (the common width W of q, k, v and dO) the backward kernel takes.
BACKWARD_MAX_HEAD = 4096
#: Whether bfloat16 calls take the backward kernel's AMX tile path where the build and the OS allow it
#: (:func:`backward_amx_available`); tests and benchmarks set it False to compare with the FMA path.
backward_amx = True


def backward_amx_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the backward kernel runs ``dtype``'s products on AMX tiles here: bfloat16 only, in a build
    with AMX-BF16 whose tile registers the OS grants (as :func:`prefill_available` asks), unless
    :data:`backward_amx` is False."""
    return dtype is torch.bfloat16 and backward_amx and prefill_available(torch.bfloat16)


def backward_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> str | None:
    """None when :func:`backward` can run these tensors here (float32, bfloat16 or float16, all one dtype:
    16-bit ones are read as they are, each value exactly a float32), else what it cannot take."""
    if not backward_available():
        return f"keyfold's native backward kernel is not built here: {why()}"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"q, k, v must be 4-d (B, H, N, W); got {q.dim()}, {k.dim()}, {v.dim()} dims"
    if not (q.device.type == k.device.type == v.device.type == "cpu"):
        return f"CPU tensors only; got {q.device}, {k.device}, {v.device}"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in _BACKWARD_DTYPES:
        return f"float32, bfloat16 or float16 q, k and v, all one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    B, Hq, _, W = q.shape
    if k.shape[0] != B or v.shape != k.shape or k.shape[-1] != W or k.shape[1] < 1 or Hq % k.shape[1]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    if not 1 <= W <= BACKWARD_MAX_HEAD:
        return f"head size {W}: from 1 to {BACKWARD_MAX_HEAD}"
    if mask is not None and (mask.dtype not in (torch.bool, torch.float32) or mask.dim() > 4):
        return f"mask: bool or float32, at most 4-d; got {mask.dtype}, {mask.dim()}-d"
    return None


def _mask_args(mask, B, Hq, Hkv, L, S):
    """(mask tensor for the kernel or None, kind, head divisor, (batch, head, row) strides)"""
    if mask is None:
        return None, 0, 1, (0, 0, 0)
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    mh = m.shape[1]
    if mh not in (1, Hq, Hkv):
        raise RuntimeError(f"native.backward: mask {tuple(mask.shape)} has {mh} heads; 1, {Hq} or {Hkv} broadcast")
    m = m.expand(B, mh, L, S)
    if m.stride(-1) != 1:
        m = m.contiguous()
    strides = tuple(m.stride(i) if m.shape[i] > 1 else 0 for i in range(3))
    return (m.view(torch.uint8) if m.dtype is torch.bool else m), (1 if m.dtype is torch.bool else 2), Hq // mh, strides


def _check_backward(caller: str, q, k, v, mask, **rows) -> None:
    """Raise where :func:`backward_takes` refuses the arguments, or naming the argument whose shape is not
    q's (``(B, Hq, L, W)`` ones) or q's rows (``(B, Hq, L)`` ones): the kernel reads them at q's strides."""
    refused = backward_takes(q, k, v, mask)
    if refused is not None:
        raise RuntimeError(f"native.{caller}: {refused}; use the fused op for these")
    for name, x in rows.items():
        if x is None:
            continue
        want = q.shape if name in ("dout", "out") else q.shape[:3]
        if tuple(x.shape) != tuple(want):
            raise RuntimeError(f"native.{caller}: {name} has shape {tuple(x.shape)}; it must be {tuple(want)} "
                               f"(q is {tuple(q.shape)})")


def _ptr(x: torch.Tensor | None):
    return None if x is None else x.data_ptr()


def _run_backward(q, k, v, out, dout, lse, lse_lo, delta, mask, causal: bool, scale: float, wide: bool,
                  sums=None, grads=(None, None, None), delta_lo=None) -> None:
    """One kf_backward call on checked arguments (q, k, v, out, dout in q's dtype, lse, lse_lo, delta and
    delta_lo float32, each made contiguous here): the gradients into ``grads`` (dq, dk, dv), or with
    ``sums`` the row sums into it."""
    global backward_amx_calls
    B, Hq, L, W = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    dt = q.dtype
    q, k, v, out, dout = (None if x is None else x.to(dt).contiguous() for x in (q, k, v, out, dout))
    lse, lse_lo, delta, delta_lo = (None if x is None else x.float().contiguous()
                                    for x in (lse, lse_lo, delta, delta_lo))
    m, mkind, mhd, ms = _mask_args(mask, B, Hq, Hkv, L, S)
    amx = backward_amx_available(dt) and not wide
    backward_amx_calls += amx
    rc = _lib.kf_backward(_ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(dout), _ptr(lse), _ptr(lse_lo), _ptr(delta),
                          _ptr(delta_lo), _ptr(m), mkind, mhd, *ms, B, Hq, Hkv, L, S, W, int(bool(causal)), scale,
                          int(wide), _BACKWARD_DTYPES[dt], int(amx), _ptr(sums),
                          *(_ptr(g) for g in grads), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"keyfold's backward kernel refused q {tuple(q.shape)}, k {tuple(k.shape)} (code {rc})")


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float,
             delta: torch.Tensor | None = None, lse_lo: torch.Tensor | None = None, wide: bool = False,
             delta_lo: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in float32 as PyTorch's fused CPU backward gives them for these arguments (its
    ``_scaled_dot_product_flash_attention_for_cpu_backward`` with ``dropout_p = 0``), with P recomputed
    by an e^x of about 1 ulp (the op's loses precision: see backward.c). q, k, v, out and dout in one
    dtype, float32, bfloat16 or float16 (out and dout are cast to q's; 16-bit values are read as the
    float32 values they are, and everything is computed in float32). q, dout, out ``(B, Hq, L, W)``,
    k, v ``(B, Hkv, S, W)`` with ``Hq`` a multiple of ``Hkv`` (a GQA group's dk and dv summed), lse
    ``(B, Hq, L)``; ``causal``: row t sees keys 0..t; ``mask`` bool (True shows) or float32 additive,
    broadcastable to ``(B, Hq | Hkv, L, S)``. ``delta``: each row's ``dO . O`` (``(B, Hq, L)``; by
    default taken from ``dout`` and ``out``) and ``lse_lo`` (the low part of a float64 lse, ``lse +
    lse_lo``), for a caller that renormalises (:func:`backward_sums`); ``wide``: scores and dP summed in
    float64 (else in float32, in the order of the prefill kernel's and the GEMM's sums), with ``dP - delta``
    taken against ``delta + delta_lo`` (the low part of a float64 delta; read only where ``wide``).

    Raises RuntimeError where :func:`backward_takes` refuses the arguments."""
    global backward_calls
    _check_backward("backward", q, k, v, mask, dout=dout, out=out, lse=lse, delta=delta, lse_lo=lse_lo,
                    delta_lo=delta_lo)
    B, Hq, L, W = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    Wp = -(-W // 16) * 16
    dq = torch.zeros(B, Hq, L, Wp, dtype=torch.float32)
    dk = torch.empty(B, Hkv, S, Wp, dtype=torch.float32)
    dv = torch.empty(B, Hkv, S, Wp, dtype=torch.float32)
    backward_calls += 1
    _run_backward(q, k, v, out, dout, lse, lse_lo, delta, mask, causal, scale, wide, grads=(dq, dk, dv),
                  delta_lo=delta_lo)
    if Wp != W:
        dq, dk, dv = (x[..., :W].contiguous() for x in (dq, dk, dv))
    return dq, dk, dv


def backward_sums(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                  causal: bool, mask: torch.Tensor | None, scale: float, wide: bool = False) -> torch.Tensor:
    """``(2, B, Hq, L)`` float64: each row's sum of P = exp(s - lse) over these keys, then of P dP
    (dP = dO . v), from the kernel's own scores (arguments as :func:`backward`; ``wide`` as the
    :func:`backward` call that takes them will have it). Summed over all of a
    row's pieces they give ``lse + log(sum P)`` and ``delta = sum P dP / sum P``: P and delta
    normalised as the naive backward's are (backward.c says why)."""
    _check_backward("backward_sums", q, k, v, mask, dout=dout, lse=lse)
    B, Hq, L = q.shape[:3]
    if B * Hq * L == 0 or k.shape[2] == 0:  # no pair: every sum is 0 (and an empty tensor has no data to pass)
        return torch.zeros(2, B, Hq, L, dtype=torch.float64)
    sums = torch.empty(2, B, Hq, L, dtype=torch.float64)
    _run_backward(q, k, v, None, dout, lse, None, None, mask, causal, scale, wide, sums=sums)
    return sums
