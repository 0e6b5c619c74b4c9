"""CPU kernels in C (engine/kernels/csrc/*.c), built on first use with the system compiler.

On CPU the model's small ops are torch twins that each make a pass over memory and pay torch's dispatch:
a layer's decode step runs ~30 of them around its four GEMMs (qwen05b: ~35 ms of a 150 ms batch-1 step,
and the padded-gather decode attention alone ~1.5-2.5 ms per layer at batch 64). The C kernels do each
job in one pass: RMSNorm with its residual add, SiLU-and-multiply, rotary, and decode attention read in
place from the paged cache. And two GEMVs: a single bf16 row times a bf16 weight and a single fp32 row times an
fp32 weight, which torch (MKL, oneDNN) runs well below DRAM bandwidth (engine/linear_fast.py uses them). And the
quantized linears (csrc/quant_kernels.c): int8 / int4 weights in engine/quant_format.py's layout, dequantized
in registers, for one row (GEMV) and few rows. And sampling (csrc/sample.c: temperature, the top-k / top-p / min-p
cutoff, the draws, logprobs; engine/sampler.py holds their twins).

Build: `cc -O3 -march=native -fopenmp -ffp-contract=off -shared csrc/*.c` into $DUET_CACHE_DIR/kernels (default
~/.cache/duet/kernels), one library per sources, flags, compiler and CPU, written atomically; later processes load
it without compiling. No compiler, or a failed build, leaves the twins in place (logged once).
`DUET_CPU_KERNELS=0` is the documented override that keeps the twins.

The wrappers below (`*_native`) take and return tensors like their twins and check what the C side
assumes (CPU, dtype, unit last stride); the dispatchers in each kernel module call them through
`use_native(x)`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine.cache_dir import cache_lock, duet_cache_dir
from engine.quant_format import INT4_GROUP, QuantizedWeight

log = logging.getLogger("duet.engine")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "cpu_kernels.c", CSRC / "gemv.c", CSRC / "quant_kernels.c", CSRC / "quant_vnni.c",
           CSRC / "quant_panels.c", CSRC / "decode_layer.c", CSRC / "sample.c")
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math", "-shared", "-fPIC"]
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM, MAX_GROUP = 512, 64  # the C side's fixed buffers (cpu_kernels.c)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    return duet_cache_dir() / "kernels"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags (a shared home directory may serve
    machines of several kinds)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, flags: list[str] = FLAGS) -> Path:
    """The library for this source, compiler, `flags` and CPU, compiled unless the cache has it."""
    sources = [path.read_bytes() for path in (*SOURCES, *sorted(CSRC.glob("*.h")))]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([*sources, " ".join(flags).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    target = cache_dir() / f"duet_cpu_kernels-{key}.so"
    if target.is_file():
        return target
    with cache_lock(f"kernels-{key}"):  # processes starting together: one compiles, the others wait for it
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                           check=True)
            os.replace(tmp, target)  # atomic: a reader never loads half a library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def load(path: Path) -> ctypes.CDLL:
    """A built library with its functions' signatures declared."""
    return _declare(ctypes.CDLL(str(path)))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "duet_add_rms_norm": [p, i64, p, i64, p, f32, p, p, i64, i64, i32],
        "duet_silu_and_mul": [p, i64, p, i64, i64, i32],
        "duet_rotary": [p, i64, i64, p, p, p, i64, i64, i64, i32],
        "duet_decode_attention": [p, i64, i64, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, f32, i32],
        "duet_gemv_bf16": [p, i64, p, p, p, i64, i64],
        "duet_gemv_f32": [p, i64, p, p, p, i64, i64],
        "duet_rotary_store_kv": [p, i64, i64, p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i32],
        "duet_int8_linear": [p, i64, p, p, i64, p, p, i64, i64, i64, i32],
        "duet_int4_linear": [p, i64, p, p, p, p, p, i64, i64, i64, i32],
        "duet_int8_dequantize": [p, p, i64, p, i64, i64],
        "duet_int4_dequantize": [p, p, p, p, i64, i64],
        "duet_quant_vector_bits": [],
        "duet_quantize_activations": [p, i64, i64, i64, p, p, p],
        "duet_quantized_linear_q8": [p, i64, i32, p, p, p, i64, p, p, i64, i64, i64, i32],
        "duet_quant_int8_dot_bits": [],
        "duet_quant_panels_bf16_available": [],
        "duet_decode_layers": [p, p, i64, p, p, p, p, p, p, p, p, p, i64, i64, p],  # engine/fused_decode.py
        "duet_decode_layer_scratch_bytes": [p, i64],
        "duet_decode_argmax": [p, p, p, p, p, i64, p, p],  # engine/fused_decode.py
        "duet_decode_logits": [p, p, p, p, p, i64, p, p],
        "duet_decode_inputs": [p, p, p, i64, p, i64, p, p, i64, p, p, p],
        "duet_decode_argmax_scratch_bytes": [p, i64, i64],
        "duet_argmax_rows": [p, i64, i64, i64, p],
        "duet_sample_shape": [p, i64, i64, i64, p, p, i64, p],  # engine/sampler.py
        "duet_sample_draw": [p, i64, p, i64, i64, p, p, p, p],
        "duet_seeded_uniforms": [ctypes.c_uint64, i64, p],
        "duet_philox4x32_10": [p, p, p],
        "duet_logprobs": [p, i64, i64, i64, p, i64, p, p, p, p],
    }
    returns = {"duet_rotary_store_kv": i64, "duet_quant_vector_bits": i32, "duet_quant_int8_dot_bits": i32,
               "duet_quant_panels_bf16_available": i32, "duet_decode_layers": i64,
               "duet_decode_layer_scratch_bytes": i64, "duet_decode_argmax_scratch_bytes": i64,
               "duet_decode_inputs": i64, "duet_logprobs": i64}
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, returns.get(name)
    return lib


def native_library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it if needed; None where it cannot be had (then twins run)."""
    global _library, _tried
    if _tried:
        return _library
    with _lock:
        if _tried:
            return _library
        try:
            if os.environ.get("DUET_CPU_KERNELS", "1") == "0":
                log.info("cpu_kernels event=disabled reason=DUET_CPU_KERNELS=0")
            elif (compiler := _compiler()) is None:
                log.warning("cpu_kernels event=unavailable reason=no C compiler (cc/gcc, or $CC): torch twins run")
            else:
                path = _build(compiler)
                _library = load(path)
                log.info("cpu_kernels event=loaded path=%s", path)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            log.warning("cpu_kernels event=unavailable reason=build failed: %s", detail.strip()[-2000:])
            _library = None
        _tried = True
    return _library


def use_native(x: torch.Tensor) -> bool:
    """Whether the dispatchers run the C kernel for `x`: a CPU tensor of float32 or bfloat16, library built."""
    return x.is_cpu and x.dtype in DTYPES and (_library if _tried else native_library()) is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dense(t: torch.Tensor, dtype: torch.dtype, numel: int, name: str) -> torch.Tensor:
    """`t` as a contiguous run of `numel` elements of `dtype`, converted or copied only where it is not one
    already (the wrappers run ~150 times a decode step: a no-op `.to()` there costs ~10 us on a cold cache)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements: must have {numel}")
    return t


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def add_rms_norm_native(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual), or (rms_norm(x) * weight, None) without a residual;
    x, residual [T, hidden] (any row stride), weight [hidden] in x's dtype."""
    lib = native_library()
    rows, hidden = x.shape
    x = _unit_last(x)
    weight = _dense(weight, x.dtype, hidden, "weight")
    out = torch.empty((rows, hidden), dtype=x.dtype)
    residual_out = None
    if residual is not None:
        residual = _unit_last(residual if residual.dtype == x.dtype else residual.to(x.dtype))
        residual_out = torch.empty((rows, hidden), dtype=x.dtype)
    lib.duet_add_rms_norm(x.data_ptr(), x.stride(0), _ptr(residual), 0 if residual is None else residual.stride(0),
                          weight.data_ptr(), eps, out.data_ptr(), _ptr(residual_out), rows, hidden, _bf16(x))
    return out, residual_out


def silu_and_mul_native(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 * intermediate] = [gate | up] -> [T, intermediate]."""
    lib = native_library()
    gate_up = _unit_last(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    lib.duet_silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, _bf16(gate_up))
    return out


def argmax_native(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for float32 x [rows, n] on CPU (the first maximum; a NaN counts as the maximum)."""
    lib = native_library()
    x = _unit_last(x)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.duet_argmax_rows(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


def sample_shape_native(logits: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Sampler._shape` for float32 logits [rows, V] on CPU: (x, cutoff), x [rows, V] the logits over each row's
    temperature made finite, cutoff [rows] the value below which top-k / top-p / min-p drop a token. table
    [rows, 4] float32: temperature (> 0), top_p, min_p, top_k (V for none)."""
    lib = native_library()
    logits, table = _unit_last(logits), table.contiguous()
    rows, vocab = logits.shape
    x, cutoff = torch.empty((rows, vocab), dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    lib.duet_sample_shape(logits.data_ptr(), logits.stride(0), rows, vocab, table.data_ptr(), x.data_ptr(),
                          x.stride(0), cutoff.data_ptr())
    return x, cutoff


def sample_draw_native(x: torch.Tensor, cutoff: torch.Tensor, keys: list[int | None], u: list[float]) -> torch.Tensor:
    """Token ids [rows] drawn from softmax(x) over x >= cutoff, x float32 [rows, V] on CPU: row i by the Gumbel-max
    trick on the uniforms `seeded_uniforms_native(keys[i], V)` where it has a key (a seeded row: its (seed, step)),
    else by the inverse CDF at u[i] in [0, 1)."""
    lib = native_library()
    x, cutoff = _unit_last(x), cutoff.contiguous()
    rows = x.shape[0]
    seeded = (ctypes.c_uint8 * rows)(*[key is not None for key in keys])
    seeds = (ctypes.c_uint64 * rows)(*[key or 0 for key in keys])
    out = torch.empty(rows, dtype=torch.int64)
    lib.duet_sample_draw(x.data_ptr(), x.stride(0), cutoff.data_ptr(), rows, x.shape[1], seeded, seeds,
                         (ctypes.c_double * rows)(*u), out.data_ptr())
    return out


def seeded_uniforms_native(key: int, n: int) -> torch.Tensor:
    """float32 [n] in [0, 1): a seeded row's uniforms under `key` in [0, 2**64), token i's from Philox4x32-10
    (csrc/sample.c)."""
    out = torch.empty(n, dtype=torch.float32)
    native_library().duet_seeded_uniforms(key, n, out.data_ptr())
    return out


def logprobs_native(logits: torch.Tensor, token_ids: torch.Tensor, n_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`compute_logprobs`' numbers for float32 logits [rows, V] on CPU, under log_softmax: (chosen [rows] the logprob
    of token_ids [rows], ranks [rows], top_ids and top_logprobs [rows, n_top], best first, ties by lower id); None
    where a row holds a NaN or +inf (the caller's twin decides those)."""
    lib = native_library()
    logits, token_ids = _unit_last(logits), token_ids.to(torch.int64).contiguous()
    rows = logits.shape[0]
    chosen, ranks = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int64)
    top_ids, top_values = torch.empty((rows, n_top), dtype=torch.int64), torch.empty((rows, n_top), dtype=torch.float32)
    if lib.duet_logprobs(logits.data_ptr(), logits.stride(0), rows, logits.shape[1], token_ids.data_ptr(), n_top,
                         chosen.data_ptr(), ranks.data_ptr(), top_ids.data_ptr(), top_values.data_ptr()):
        return None
    return chosen, ranks, top_ids, top_values


def _rotary_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """What duet_rotary reads and writes: x with a unit last stride, cos/sin as dense [T, head_dim] of x's
    dtype, and the new output [T, heads, head_dim]."""
    tokens, heads, head_dim = x.shape
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"rotary: head_dim {head_dim} is invalid: must be even and <= {MAX_HEAD_DIM}")
    x = _unit_last(x)
    cos, sin = _dense(cos, x.dtype, tokens * head_dim, "cos"), _dense(sin, x.dtype, tokens * head_dim, "sin")
    return x, cos, sin, torch.empty((tokens, heads, head_dim), dtype=x.dtype)


def rotary_native(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin ([T, 1, head_dim] or [T, head_dim], any float dtype: cast
    to x's as the twin's products are) -> a new contiguous tensor."""
    lib = native_library()
    tokens, heads, head_dim = x.shape
    x, cos, sin, out = _rotary_args(x, cos, sin)
    lib.duet_rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens,
                    heads, head_dim, _bf16(x))
    return out


def rotary_store_kv_native(
    x: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`rotary_native(x, cos, sin)`, and the step's K (x's last kv_heads heads, rotated) and V ([T, kv_heads,
    head_dim]) stored at `slots` [T] of the caches [kv_heads, num_blocks, block_size, head_dim], as write_kv."""
    lib = native_library()
    tokens, heads, head_dim = x.shape
    kv_heads = k_cache.shape[0]
    if kv_heads > heads:
        raise ValueError(f"rotary_store_kv: kv_heads {kv_heads} is invalid: x has only {heads} heads")
    same_dtype = k_cache.dtype == v_cache.dtype == v.dtype == x.dtype
    if not (same_dtype and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"rotary_store_kv: caches {k_cache.dtype}/{v_cache.dtype} and v {v.dtype} must be x's dtype "
                         f"{x.dtype}, the caches contiguous")
    if v.shape != (tokens, kv_heads, head_dim) or k_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary_store_kv: v {tuple(v.shape)} / cache {tuple(k_cache.shape)} do not fit x "
                         f"{tuple(x.shape)} with {kv_heads} kv heads")
    x, cos, sin, out = _rotary_args(x, cos, sin)
    if v.stride(2) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    slots = _dense(slots, torch.int64, tokens, "slot_mapping")
    num_slots = k_cache.numel() // (kv_heads * head_dim)
    bad = lib.duet_rotary_store_kv(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                   out.data_ptr(), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                   slots.data_ptr(), num_slots, tokens, heads, kv_heads, head_dim, _bf16(x))
    if bad:
        raise ValueError(f"slot_mapping[{bad - 1}] = {int(slots[bad - 1])} is invalid: must be in [0, {num_slots})")
    return out


def decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """As `decode_attention_torch`, read in place from the paged cache (no gathered copy), with each sequence's
    context length (`context_lens` [B]) where the twin takes the mask: a length is read within [0, width *
    block_size] (the block tables' width), so no length reads outside its table."""
    lib = native_library()
    batch, heads, head_dim = q.shape
    kv_heads, num_blocks, block_size = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"K/V cache dtype {k_cache.dtype}/{v_cache.dtype} is invalid: must be q's, {q.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("K/V caches must be contiguous")
    if head_dim > MAX_HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        raise ValueError(f"heads={heads}, kv_heads={kv_heads}, head_dim={head_dim} is invalid: heads must be a "
                         f"multiple of kv_heads, at most {MAX_GROUP} per kv head, and head_dim <= {MAX_HEAD_DIM}")
    q = _unit_last(q)
    width = block_ids.numel() // batch
    block_ids = _dense(block_ids, torch.int64, batch * width, "block_ids")
    context_lens = _dense(context_lens, torch.int32, batch, "context_lens")
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype)
    lib.duet_decode_attention(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                              block_ids.data_ptr(), context_lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads,
                              head_dim, num_blocks, block_size, width, scale, _bf16(q))
    return out


GEMV_MAX_ROWS = 32  # rows of x the C GEMVs take (csrc/gemv.c)


def gemv_bf16_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for 1..GEMV_MAX_ROWS bf16 rows: x [..., in] and weight [out, in] bf16 -> [rows, out] bf16, accumulated
    in float32 and rounded once (after the bias); the weight is read once for all rows, and each row's result is the
    one it has alone."""
    return _gemv(x, weight, bias, torch.bfloat16, "duet_gemv_bf16")


def gemv_f32_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`gemv_bf16_native` in fp32 (csrc/gemv.c; equal to F.linear up to float32 summation order)."""
    return _gemv(x, weight, bias, torch.float32, "duet_gemv_f32")


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, fn: str
          ) -> torch.Tensor:
    name = fn.removeprefix("duet_") + "_native"
    n_out, k_in = weight.shape
    rows = x.numel() // k_in if k_in else 0
    if x.dtype != dtype or weight.dtype != dtype or x.shape[-1] != k_in or not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} are "
                         f"invalid: must be 1 to {GEMV_MAX_ROWS} {dtype} rows of {k_in} and a {dtype} weight")
    if bias is not None and (bias.dtype != dtype or bias.numel() != n_out):
        raise ValueError(f"{name}: bias {tuple(bias.shape)} {bias.dtype} is invalid: must be {n_out} {dtype}")
    x, weight = x.reshape(rows, k_in).contiguous(), _contiguous(weight)
    bias = None if bias is None else bias.contiguous()
    y = torch.empty((rows, n_out), dtype=dtype)
    getattr(native_library(), fn)(x.data_ptr(), rows, weight.data_ptr(), _ptr(bias), y.data_ptr(), n_out, k_in)
    return y


class NativeQuantizedLinear:
    """One quantized weight (and bias) bound to its C kernel, checked and converted once: a call only turns x into
    a pointer and a row count. The checked wrappers below cost ~40 us a call on the 2-core VM (tensor checks,
    reshapes, 13 ctypes conversions), more than the kernel on a small weight, and a decode step makes ~120 such
    calls; a QuantizedLinear holds one of these (engine/kernels/quant_linear.py). The weight's tensors must not
    change while it is bound (a loaded model's never do). `int8_activations`: x's rows rounded to int8 per 32
    inputs and integer dot products (`quantized_linear_int8_activations_reference` is that path's twin)."""

    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None = None, int8_activations: bool = False):
        lib = native_library()
        if lib is None:
            raise RuntimeError("quantized linears: the C kernels are not built here (see the cpu_kernels log line)")
        _check_quantized(w)
        if int8_activations and w.in_features % INT4_GROUP:
            raise ValueError(f"in_features {w.in_features} is invalid for int8 activations: must be a multiple of "
                             f"{INT4_GROUP}")
        self.in_features, self.out_features = w.in_features, w.out_features
        self.kind, self.group_size, self.int8_activations = w.kind, w.group_size, int8_activations
        qweight, scales = _contiguous(w.qweight), _contiguous(w.scales)
        mins = None if w.mins is None else _contiguous(w.mins)
        if bias is not None:
            bias = _dense(bias, torch.float32, w.out_features, "bias")
        self._tensors = (qweight, scales, mins, bias)  # held: the pointers below point into them
        n, k = w.out_features, w.in_features
        if int8_activations:
            self._fn = lib.duet_quantized_linear_q8
            self._weight_args = (4 if w.kind == "int4" else 8, qweight.data_ptr(), scales.data_ptr(), _ptr(mins),
                                 w.group_size, _ptr(bias))
        elif w.kind == "int8":
            self._fn = lib.duet_int8_linear
            self._weight_args = (qweight.data_ptr(), scales.data_ptr(), w.group_size, _ptr(bias))
        else:
            self._fn = lib.duet_int4_linear
            self._weight_args = (qweight.data_ptr(), scales.data_ptr(), _ptr(mins), _ptr(bias))
        self._sizes = (n, k)

    def struct_fields(self) -> tuple:
        """(kind 4/8, int8_activations, qweight, scales, mins, bias pointers, group, out, in): csrc/decode_layer.c's
        duet_qlinear, valid while this object lives."""
        qweight, scales, mins, bias = self._tensors
        return (4 if self.kind == "int4" else 8, int(self.int8_activations), qweight.data_ptr(), scales.data_ptr(),
                _ptr(mins), _ptr(bias), self.group_size, self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] on the CPU, float32 or bfloat16 -> [..., out] in x's dtype."""
        k = self.in_features
        if not x.is_cpu or x.dtype not in DTYPES or x.shape[-1] != k:
            raise ValueError(f"quantized linear: x {tuple(x.shape)} {x.dtype} on {x.device} is invalid: must be a "
                             f"CPU float32 / bfloat16 tensor [..., {k}]")
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):  # a broadcast row: the C side reads rows apart
            x2 = x2.contiguous()
        rows = x2.shape[0]
        y = torch.empty((rows, self.out_features), dtype=x.dtype)
        self._fn(x2.data_ptr(), x2.stride(0), *self._weight_args, y.data_ptr(), rows, *self._sizes,
                 int(x.dtype == torch.bfloat16))
        return y.view(*x.shape[:-1], self.out_features)


def quantized_linear_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (CPU, float32 or bfloat16) times `w`'s weight (int8 or int4, engine/quant_format.py) plus `bias`
    -> [..., out] in x's dtype: the weight dequantized in registers, products summed in float32, rounded once.
    Equals `quantized_linear_reference` up to float32 summation order. For any row count; fastest for few rows
    (the weight is read once, x's rows in tiles of 4 share each unpacked block)."""
    return NativeQuantizedLinear(w, bias)(x)


def quantized_linear_int8_activations_native(x: torch.Tensor, w: QuantizedWeight,
                                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized_linear_native` with x's rows rounded to int8 per 32 inputs first (`quantize_activations`) and
    integer dot products per block: fewer instructions a block, at the price of x's rounding. Equals
    `quantized_linear_int8_activations_reference` up to float32 summation order. in_features a multiple of 32."""
    return NativeQuantizedLinear(w, bias, int8_activations=True)(x)


def quantize_activations_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` (engine/quant_format.py) in C: (qx int8 [rows, in], dx float32 [rows, in / 32])."""
    lib = native_library()
    x = _unit_last(_dense(x, torch.float32, x.numel(), "x").reshape(x.shape))
    rows, k_in = x.shape
    qx = torch.empty((rows, k_in), dtype=torch.int8)
    dx, sx = torch.empty((rows, k_in // INT4_GROUP)), torch.empty((rows, k_in // INT4_GROUP))
    lib.duet_quantize_activations(x.data_ptr(), x.stride(0), rows, k_in, qx.data_ptr(), dx.data_ptr(), sx.data_ptr())
    return qx, dx


def int8_linear_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized_linear_native` for an int8 weight (per channel, or groups of a multiple of 32: GGUF Q8_0)."""
    if w.kind != "int8":
        raise ValueError(f"int8_linear_native: weight kind {w.kind!r} is invalid: must be 'int8'")
    return quantized_linear_native(x, w, bias)


def int4_linear_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized_linear_native` for an int4 weight (groups of 32 with scales and mins: GGUF Q4_0 / Q4_1)."""
    if w.kind != "int4":
        raise ValueError(f"int4_linear_native: weight kind {w.kind!r} is invalid: must be 'int4'")
    return quantized_linear_native(x, w, bias)


def dequantize_native(w: QuantizedWeight) -> torch.Tensor:
    """`dequantize(w)` in one pass: float32 [out, in], each value q * s (+ m) as the twin computes it."""
    lib = native_library()
    if lib is None:
        raise RuntimeError("dequantize_native: the C kernels are not built here (see the cpu_kernels log line)")
    _check_quantized(w)
    out = torch.empty((w.out_features, w.in_features), dtype=torch.float32)
    qweight, scales = _contiguous(w.qweight), _contiguous(w.scales)
    if w.kind == "int8":
        lib.duet_int8_dequantize(qweight.data_ptr(), scales.data_ptr(), w.group_size, out.data_ptr(),
                                 w.out_features, w.in_features)
    else:
        lib.duet_int4_dequantize(qweight.data_ptr(), scales.data_ptr(), _contiguous(w.mins).data_ptr(),
                                 out.data_ptr(), w.out_features, w.in_features)
    return out


def dequantized_linear_native(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Many rows: the weight dequantized to float32 for this call only (`dequantize_native`), then torch's GEMM,
    whose blocking reuses x from cache far better than a per-output-row kernel can (the twin's arithmetic)."""
    y = torch.nn.functional.linear(x.float(), dequantize_native(w), None if bias is None else bias.float())
    return y.to(x.dtype)


def quantized_native_applies(x: torch.Tensor, w: QuantizedWeight) -> bool:
    """Whether `quantized_linear_native` takes this call here: the library is built, x is CPU fp32 / bf16, and the
    weight is one the C side reads (engine/kernels/quant_linear.py asks before picking it)."""
    return x.is_cpu and x.dtype in DTYPES and _quantized_problem(w) is None and native_library() is not None


def _quantized_problem(w: QuantizedWeight) -> str | None:
    if not w.qweight.is_cpu:
        return f"quantized weight on {w.qweight.device} is invalid: the C kernels take CPU tensors"
    if w.kind == "int8" and w.group_size != w.in_features and w.group_size % INT4_GROUP:
        return (f"int8 group_size {w.group_size} is invalid for the C kernels: must be in_features "
                f"({w.in_features}) or a multiple of {INT4_GROUP}")
    return None


def _check_quantized(w: QuantizedWeight) -> None:
    if (problem := _quantized_problem(w)) is not None:
        raise ValueError(problem)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
