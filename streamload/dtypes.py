"""safetensors dtype names <-> torch dtypes."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import UnsupportedError


class DType(NamedTuple):
    """One safetensors dtype: its width and, if this torch has one, its torch dtype."""

    name: str
    bits: int
    torch_dtype: torch.dtype | None
    floating: bool  # subject to the `dtype=` conversion (fp8, complex and packed types are not)
    packed: int  # how many format elements one torch element holds (2 for F4 as float4_e2m1fn_x2)

    def nbytes(self, numel: int) -> int | None:
        """Bytes that `numel` elements take, or None when they do not fill whole bytes."""
        bits = numel * self.bits
        return bits // 8 if bits % 8 == 0 else None


def _opt(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


_TABLE: list[tuple[str, int, torch.dtype | None, bool]] = [
    ("F64", 64, torch.float64, True),
    ("F32", 32, torch.float32, True),
    ("F16", 16, torch.float16, True),
    ("BF16", 16, torch.bfloat16, True),
    ("I64", 64, torch.int64, False),
    ("I32", 32, torch.int32, False),
    ("I16", 16, torch.int16, False),
    ("I8", 8, torch.int8, False),
    ("U64", 64, _opt("uint64"), False),
    ("U32", 32, _opt("uint32"), False),
    ("U16", 16, _opt("uint16"), False),
    ("U8", 8, torch.uint8, False),
    ("BOOL", 8, torch.bool, False),
    ("C64", 64, torch.complex64, False),
    ("F8_E4M3", 8, _opt("float8_e4m3fn"), False),
    ("F8_E5M2", 8, _opt("float8_e5m2"), False),
    ("F8_E4M3FNUZ", 8, _opt("float8_e4m3fnuz"), False),
    ("F8_E5M2FNUZ", 8, _opt("float8_e5m2fnuz"), False),
    ("F8_E8M0", 8, _opt("float8_e8m0fnu"), False),
    ("F6_E2M3", 6, None, False),
    ("F6_E3M2", 6, None, False),
    ("F4", 4, _opt("float4_e2m1fn_x2"), False),
]


def _packed(bits: int, td: torch.dtype | None) -> int:
    return 1 if td is None else max(1, td.itemsize * 8 // bits)


# `packed` computed once here: it is asked of each tensor a plan makes
DTYPES: dict[str, DType] = {name: DType(name, bits, td, fl, _packed(bits, td)) for name, bits, td, fl in _TABLE}


def torch_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The torch shape of a tensor of the format's `shape`; None if torch cannot hold it."""
    if dtype.torch_dtype is None:
        return None
    k = dtype.packed
    if k == 1:
        return shape
    if not shape or shape[-1] % k:
        return None
    return (*shape[:-1], shape[-1] // k)


def as_torch_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype, or its name ("float16", "torch.bfloat16"), as the command line takes it."""
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise UnsupportedError(
            f"dtype={value!r} is not a torch dtype: pass one (torch.float16) or its name ('float16', 'bfloat16', "
            "'float32')"
        )
    return found
