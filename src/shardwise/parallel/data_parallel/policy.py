"""MixedPrecisionPolicy: which dtypes fully_shard computes, reduces and returns in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Dtypes for the gathered parameters, the gradient reduction and the module output.

    The sharded parameters (and so the optimizer state) keep their own dtype; only the
    gathered copies used by forward/backward are cast.

    Args:
        param_dtype: dtype of the gathered parameters (and of the all_gather); None keeps the
            parameters' dtype.
        reduce_dtype: dtype gradients are reduced in; None uses ``param_dtype`` (or the
            gradients' dtype). Reduced gradients are cast to the sharded parameter's dtype.
        output_dtype: cast floating-point outputs of the module to this dtype; None leaves them.
        cast_forward_inputs: cast floating-point inputs of the module to ``param_dtype``.

    Example:
        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy.{name} must be a floating-point torch.dtype or None, got {value!r}")
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}")
