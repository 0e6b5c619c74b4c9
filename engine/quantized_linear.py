"""`QuantizedLinear`: an `nn.Linear` whose weight is held quantized (engine/quant_format.py), for inference.

The weight's tensors are buffers (qweight, scales, mins), so `.to(device)`, `state_dict` and the memory report
see them; the bias, when there is one, stays a dense parameter in the model's dtype and is loaded by the one
loader (engine/weights.py) like any other. `forward` calls the dispatcher (engine/kernels/quant_linear.py).
A row-parallel (tensor-parallel) layer sets `all_reduce`: the partial products are summed over ranks before
the bias is added once, as engine/tensor_parallel.py's RowParallelLinear does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.kernels.quant_linear import quantized_linear
from engine.quant_format import QuantizedWeight


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 all_reduce: Callable[[torch.Tensor], None] | None = None):
        super().__init__()
        self.kind, self.group_size = weight.kind, weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} must be ({self.out_features},)")
        self.all_reduce = all_reduce
        self._weight = weight

    @property
    def weight_q(self) -> QuantizedWeight:
        """The weight as the kernels take it (valid until the module is moved again)."""
        return self._weight

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)  # moves the buffers; the QuantizedWeight view is rebuilt over the new ones
        self._weight = QuantizedWeight(self.kind, self.qweight, self.scales, self.mins, self.group_size)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:
            return quantized_linear(x, self._weight, self.bias)
        y = quantized_linear(x, self._weight, None)
        self.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")
