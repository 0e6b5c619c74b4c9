"""`FusedDecode`: a decode-only step's layers in one C call (engine/kernels/csrc/decode_layer.c), a fast
path of ModelRunner for CPU models whose linears all run C kernels: quantized ones, or dense fp32 / bf16 ones
whose few rows take the C GEMVs (engine/linear_fast.py's `gemv`; such a model's steps of up to DENSE_ROWS rows).

Why: at batch 1 a layer's kernels take ~0.3 ms and the Python around them (nine wrappers: tensor checks,
allocations, ctypes conversions, module calls) about as much again (benchmarks/RESULTS.md, issue 18 part 2).
Here every weight's pointers are bound once into C structs, and a step makes one call for all layers into code that
runs the same kernels on the same inputs in the same order as the plain forward (engine/model.py, the reference:
equal bit for bit, tests/test_fused_decode.py).

Applies when: CPU, the C kernels built, no tensor parallelism, fp32 or bf16 activations, and every layer's four
linears either `QuantizedLinear`s bound to a native kernel or `FastLinear`s with a C GEMV of the activations'
dtype. The structs point into the model's tensors and the KV
caches given at construction: valid while those live (a ModelRunner owns both for its life).

Where the lm_head is such a linear too, `logits` goes on to the step's logits in one more call (final norm, lm_head),
without their wrappers (~0.3-0.5 ms a step at batch 1), and `argmax` to each row's greedy token (and the argmax):
for steps whose sampling is only that argmax (engine/sampler.py's `reduces_to_argmax`), which then skip the sampler
too (~0.4-0.7 ms a step at batch 1, 4-6 %, tenth session's prototype).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from engine.attention import AttentionMetadata
from engine.kernels import cpu_native
from engine.linear_fast import GEMV_ROWS, FastLinear
from engine.model import LlamaForCausalLM
from engine.quantized_linear import QuantizedLinear

KVCache = tuple[torch.Tensor, torch.Tensor]
p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
DENSE_BF16, DENSE_F32 = 16, 32  # csrc/decode_layer.c's duet_qlinear kinds for plain weights
# A dense model's fused steps take up to this many rows, all the C GEMV takes, though from GEMV_ROWS on a plain call
# would give them to oneDNN: the fused layer saves the per-layer Python besides (SmolLM2 bf16 decode, 2026-11-28: at
# batch 12 1.21x, 16 1.18x, 32 1.05x the plain forward; fp32 at 32 equal). Its results equal a plain forward whose
# linears send as many rows to the C GEMV (tests/test_fused_decode.py).
DENSE_ROWS = cpu_native.GEMV_MAX_ROWS


class _QLinear(ctypes.Structure):
    _fields_ = [("kind", i32), ("int8_activations", i32), ("qweight", p), ("scales", p), ("mins", p), ("bias", p),
                ("group", i64), ("n_out", i64), ("k_in", i64)]


class _LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", p), ("post_norm", p), ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear),
                ("down", _QLinear)]


class _LayerShape(ctypes.Structure):
    _fields_ = [("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64), ("inter", i64),
                ("num_blocks", i64), ("block_size", i64), ("eps", f32), ("scale", f32), ("bf16", i32)]


class FusedDecode:
    @classmethod
    def for_model(cls, model: LlamaForCausalLM, kv_caches: list[KVCache]) -> FusedDecode | None:
        """The fast path for this model and these caches, or None where it does not apply (see the docstring)."""
        lib = cpu_native.native_library()
        dtype = model.embed_tokens.weight.dtype
        if lib is None or model.gather_vocab is not None or dtype not in cpu_native.DTYPES:
            return None
        if not all(k.is_cpu and k.dtype == dtype and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return None
        bound = [[_bind_linear(m, dtype) for m in _linears(layer)] for layer in model.layers]
        if any(b is None for layer in bound for b in layer):
            return None
        # the lm_head only as far as its plain calls run the same C kernel: a dense one's up to GEMV_ROWS rows (a
        # tied dense lm_head, F.linear on the embedding, never)
        lm_head = None if model.lm_head is None else _bind_linear(model.lm_head, dtype, dense_rows=GEMV_ROWS)
        return cls(model, kv_caches, lib, bound, lm_head)

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], lib: ctypes.CDLL,
                 bound: list[list[_BoundLinear]], lm_head: _BoundLinear | None = None):
        self.model, self.kv_caches = model, kv_caches
        # the most rows every linear's own dispatch gives its C kernel (quantized: more go to dequantize + GEMM;
        # dense: more go to oneDNN's GEMM, which reads the weight once for all rows)
        self.max_rows = min(b.max_rows for layer in bound for b in layer)
        self._layers, self._scratch_bytes = lib.duet_decode_layers, lib.duet_decode_layer_scratch_bytes
        self._argmax, self._argmax_scratch_bytes = lib.duet_decode_argmax, lib.duet_decode_argmax_scratch_bytes
        self._logits, self._inputs = lib.duet_decode_logits, lib.duet_decode_inputs
        self.lm_head_max_rows = 0 if lm_head is None else min(self.max_rows, lm_head.max_rows)
        config, dtype = model.config, model.embed_tokens.weight.dtype
        k_cache = kv_caches[0][0]
        self.shape = _LayerShape(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                 config.intermediate_size, k_cache.shape[1], k_cache.shape[2], config.rms_norm_eps,
                                 config.head_dim**-0.5, int(dtype == torch.bfloat16))
        # what the structs point into, kept alive here: the linears' bound kernels or weights and the norm weights
        # in the activation dtype where they had to be converted
        self._held: list[object] = [b.owner for layer in bound for b in layer]
        self.layers = (_LayerWeights * len(bound))(*(self._bind(layer, linears)
                                                      for layer, linears in zip(model.layers, bound)))
        self.k_caches = (p * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches))
        self.v_caches = (p * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches))
        if lm_head is not None:
            self._held.append(lm_head.owner)
            self.lm_head, self.final_norm = _QLinear(*lm_head.fields), self._dense(model.norm.weight)
        embed, cos, sin = (t.contiguous() for t in (model.embed_tokens.weight, model.rotary.cos, model.rotary.sin))
        self._held += [embed, cos, sin]
        self._tables = (embed.data_ptr(), embed.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[0])
        # A step's buffers, kept from step to step (grown when a step needs more), so that a step allocates nothing:
        # x, residual, cos and sin of its rows (the activations' dtype), and the scratch of the layers' call and of
        # the lm_head's (one after the other; the lm_head's holds the logits: ~0.2 MB a row)
        self._step = torch.empty(0, dtype=dtype)
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._scratch_bytes_by_rows: dict[int, int] = {}

    def _bind(self, layer, linears: list[_BoundLinear]) -> _LayerWeights:
        norms = [self._dense(n.weight) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        return _LayerWeights(norms[0], norms[1], *(_QLinear(*b.fields) for b in linears))

    def _dense(self, t: torch.Tensor) -> int:
        dtype = self.model.embed_tokens.weight.dtype
        if t.dtype != dtype or not t.is_contiguous():
            t = t.to(dtype).contiguous()
            self._held.append(t)
        return t.data_ptr()

    def applies_to(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step is one this path runs: decodes only, with the context lengths the C attention reads, and no
        more rows than the linears' C kernels take."""
        return meta.num_decode_tokens == num_tokens <= self.max_rows and meta.decode_context_lens is not None

    def takes_lm_head(self, num_tokens: int) -> bool:
        """Whether `logits` and `argmax` run a step of this many rows (one `applies_to`)."""
        return num_tokens <= self.lm_head_max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward (hidden states after the final norm) for a decode-only step (`applies_to`)."""
        rows, hidden = self._run_layers(input_ids, positions, meta), self.shape.hidden
        x, residual = self._step[: 2 * rows * hidden].view(2, rows, hidden)
        return self.model.norm.add_and_norm(x, residual)[0]

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """float32 logits [rows, vocab] for a step that `takes_lm_head`: `model.compute_logits(self(...))`, the same
        numbers (the same kernels on the same inputs). A view of this object's buffer: valid until the next step."""
        rows = self._run_layers(input_ids, positions, meta)
        vocab = self.lm_head.n_out
        at = self._argmax_scratch_bytes(ctypes.byref(self.shape), vocab, rows) - 4 * rows * vocab  # its tail
        logits = self._scratch[at : at + 4 * rows * vocab].view(torch.float32).view(rows, vocab)
        self._logits(*self._lm_head_args(rows), logits.data_ptr())
        return logits

    def argmax(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> list[int]:
        """Each row's greedy token for a step that `takes_lm_head`: `greedy_argmax(self.logits(...))`, without
        keeping the logits."""
        rows = self._run_layers(input_ids, positions, meta)
        token_ids = (ctypes.c_int64 * rows)()
        self._argmax(*self._lm_head_args(rows), token_ids)
        return list(token_ids)

    def _lm_head_args(self, rows: int) -> tuple:
        """duet_decode_logits' and duet_decode_argmax's leading arguments, after `_run_layers`."""
        x = self._step.data_ptr()
        return (ctypes.byref(self.shape), self.final_norm, ctypes.byref(self.lm_head), x,
                x + rows * self.shape.hidden * self._step.element_size(), rows, self._scratch.data_ptr())

    def _run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Runs a step's layers (input_ids and positions int64 and contiguous, as ModelRunner.prepare_inputs makes
        them); returns its rows. Leaves at the start of the step buffer x [rows, hidden], the last layer's output,
        and after it residual [rows, hidden], the stream without it: the pair the final norm adds (valid until the
        next step)."""
        shape, rows = self.shape, input_ids.shape[0]
        hidden, head_dim, esize = shape.hidden, shape.head_dim, self._step.element_size()
        if self._step.numel() < 2 * rows * (hidden + head_dim):
            self._step = torch.empty(2 * rows * (hidden + head_dim), dtype=self._step.dtype)
        scratch_bytes = self._scratch_bytes_by_rows.get(rows) or self._scratch_bytes_for(rows)
        if self._scratch.numel() < scratch_bytes:
            self._scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
        x = self._step.data_ptr()
        residual, cos = x + rows * hidden * esize, x + 2 * rows * hidden * esize
        sin = cos + rows * head_dim * esize
        bad = self._inputs(ctypes.byref(shape), input_ids.data_ptr(), positions.data_ptr(), rows, *self._tables, x,
                           cos, sin)
        if bad:
            name, index, ids, end = (("input_ids", bad - 1, input_ids, self._tables[1]) if bad > 0 else
                                     ("positions", -bad - 1, positions, self._tables[4]))
            raise ValueError(f"{name}[{index}] = {int(ids[index])} is invalid: must be in [0, {end})")
        slots = meta.slot_mapping.contiguous()
        block_ids, context_lens = meta.decode_block_ids.contiguous(), meta.decode_context_lens.contiguous()
        bad = self._layers(ctypes.byref(shape), self.layers, len(self.layers), self.k_caches, self.v_caches, x,
                           residual, cos, sin, slots.data_ptr(), block_ids.data_ptr(), context_lens.data_ptr(), rows,
                           block_ids.numel() // rows, self._scratch.data_ptr())
        if bad:
            raise ValueError(f"slot_mapping[{bad - 1}] = {int(slots[bad - 1])} is invalid: must be in "
                             f"[0, {shape.num_blocks * shape.block_size})")
        return rows

    def _scratch_bytes_for(self, rows: int) -> int:
        """The scratch a step of `rows` needs: the layers' call's or the lm_head's, the larger."""
        shape = ctypes.byref(self.shape)
        lm_head = self._argmax_scratch_bytes(shape, self.lm_head.n_out, rows) if self.lm_head_max_rows else 0
        self._scratch_bytes_by_rows[rows] = max(self._scratch_bytes(shape, rows), lm_head)
        return self._scratch_bytes_by_rows[rows]


class _BoundLinear(NamedTuple):
    fields: tuple  # duet_qlinear's, in order
    max_rows: int  # the most rows the C call is given
    owner: object  # keeps the tensors the fields point into alive


def _linears(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _bind_linear(m, dtype: torch.dtype, dense_rows: int = DENSE_ROWS) -> _BoundLinear | None:
    """A linear as the C layer runs it (a dense one for up to `dense_rows` rows), or None where it cannot (not bound
    to a C kernel, sharded, or a dense weight of another dtype than the activations')."""
    if isinstance(m, QuantizedLinear):
        kernel = m.native_kernel() if m.all_reduce is None else None
        return None if kernel is None else _BoundLinear(kernel.struct_fields(), m.native_max_rows(), kernel)
    gemv = m.gemv if isinstance(m, FastLinear) else None
    if gemv is None or gemv.weight.dtype != dtype or not gemv.weight.is_contiguous():
        return None
    bias = 0 if gemv.bias is None else gemv.bias.data_ptr()
    kind = DENSE_BF16 if dtype == torch.bfloat16 else DENSE_F32
    return _BoundLinear((kind, 0, gemv.weight.data_ptr(), 0, 0, bias, 0, m.out_features, m.in_features), dense_rows,
                        gemv)
