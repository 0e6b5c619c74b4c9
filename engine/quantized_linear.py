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

from engine.kernels.cpu_native import NativeQuantizedLinear
from engine.kernels.quant_linear import PreparedQuantizedLinear
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
        self.int8_activations = False  # set by `use_int8_activations`
        self._bind(weight)

    def _bind(self, weight: QuantizedWeight) -> None:
        self._weight = weight
        self._kernel: PreparedQuantizedLinear | None = None  # bound on first use (loading fills the tensors first)

    def _bound_kernel(self) -> PreparedQuantizedLinear:
        """The kernel bound to this weight (and bias, unless a row-parallel layer adds it after the all-reduce),
        bound again if any of those tensors' storage changed since (a loader that assigns `.data`)."""
        bias = self.bias if self.all_reduce is None else None
        tensors = (self.qweight, self.scales, self.mins, bias)
        kernel = self._kernel
        if kernel is None or not kernel.bound_to(tensors):
            kernel = self._kernel = PreparedQuantizedLinear(self._weight, bias, self.int8_activations)
        return kernel

    @property
    def weight_q(self) -> QuantizedWeight:
        """The weight as the kernels take it (valid until the module is moved again)."""
        return self._weight

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)  # moves the buffers; the QuantizedWeight view is rebuilt over the new ones
        self._bind(QuantizedWeight(self.kind, self.qweight, self.scales, self.mins, self.group_size))
        return self

    def native_kernel(self) -> NativeQuantizedLinear | None:
        """The C kernel this layer's few-row calls run (None: not bound to one: no library, or not a CPU weight)."""
        return self._bound_kernel().native

    def native_max_rows(self) -> int:
        """The most rows a call gives the C kernel (more go to dequantize + GEMM)."""
        return self._bound_kernel().native_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is None:
            return self._bound_kernel()(x)
        y = self._bound_kernel()(x)
        self.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


def use_int8_activations(model: nn.Module) -> int:
    """Every QuantizedLinear of `model` rounds its input to int8 per 32 inputs and takes the C kernels' integer dot
    products (`--quantized-activations int8`); the number of layers switched. A transformation of a loaded model,
    like engine/linear_fast.py's: the weights are not touched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            if module.in_features % 32:
                raise ValueError(f"quantized_activations='int8' is invalid for this model: a quantized linear takes "
                                 f"{module.in_features} inputs, not a multiple of 32")
            module.int8_activations, module._kernel = True, None
            switched += 1
    return switched
