"""engine/quant_format.py: the int4 layout, round-to-nearest's error bounds, and the twins' definition."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.quant_format import (
    QuantizedWeight,
    concat_rows,
    dequantize,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantized_linear_reference,
    unpack_int4,
)


@settings(max_examples=50, deadline=None, derandomize=True, database=None)
@given(rows=st.integers(1, 5), groups=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_int4_pack_unpack_round_trips_in_the_drawn_layout(rows, groups, seed):
    q = torch.randint(0, 16, (rows, 32 * groups), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (rows, 16 * groups) and torch.equal(unpack_int4(packed), q)
    # byte j of group g: input 32g + j low, input 32g + j + 16 high
    g, j = groups - 1, 5
    assert int(packed[0, 16 * g + j]) == int(q[0, 32 * g + j]) | int(q[0, 32 * g + j + 16]) << 4


def test_round_to_nearest_is_within_half_a_step():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0  # a zero row: scale 0, exact
    for quantize, step_of in ((quantize_int8, lambda q: q.scales.repeat_interleave(q.group_size, dim=1)),
                              (quantize_int4, lambda q: q.scales.repeat_interleave(32, dim=1))):
        q = quantize(w)
        error = (dequantize(q) - w).abs()
        assert bool((error <= step_of(q) / 2 + 1e-6).all())
        assert torch.equal(dequantize(q)[3], torch.zeros(96))
    assert quantize_int8(w).group_size == 96 and quantize_int4(w).group_size == 32
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 40))


def test_q4_0_is_scales_and_minus_eight_scales_exactly():
    """GGUF Q4_0's d * (q - 8) as this layout's scales * q + mins: the same fp32 numbers."""
    d = torch.tensor([[0.0123], [-0.5]]).half().float()
    q = torch.randint(0, 16, (2, 32), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    w = QuantizedWeight("int4", pack_int4(q), d, -8 * d, 32)
    assert torch.equal(dequantize(w), d * (q.float() - 8))


def test_rows_concat_and_the_reference_linear():
    g = torch.Generator().manual_seed(2)
    a, b = quantize_int4(torch.randn(8, 64, generator=g)), quantize_int4(torch.randn(4, 64, generator=g))
    fused = concat_rows([a, b])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))
    assert torch.equal(dequantize(fused.rows(8, 12)), dequantize(b))
    with pytest.raises(ValueError, match="cannot fuse"):
        concat_rows([a, quantize_int8(torch.randn(4, 64))])
    x = torch.randn(3, 64, generator=g)
    bias = torch.randn(12, generator=g)
    assert torch.allclose(quantized_linear_reference(x, fused, bias), x @ dequantize(fused).T + bias, atol=1e-5)
    assert quantized_linear_reference(x.bfloat16(), fused).dtype == torch.bfloat16
    assert fused.nbytes == 12 * 32 + 2 * 12 * 2 * 4  # packed values, scales and mins
