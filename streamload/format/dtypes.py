"""safetensors dtype names <-> torch dtypes."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from streamload.base.errors import UnsupportedError

if TYPE_CHECKING:
    import torch

# torch is imported when a dtype's torch side is first asked for, not with this module: reading and
# validating headers (a fetch process, the format, the storages) needs none (~2.5 s of imports).


class DType(NamedTuple):
    """One safetensors dtype: its width and, if this torch has one, its torch dtype."""

    name: str
    bits: int
    torch_name: str  # the torch dtype's name ("" where torch has none)
    floating: bool  # subject to the `dtype=` conversion (fp8, complex and packed types are not)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return _torch()[self.name][0]

    @property
    def packed(self) -> int:
        """How many format elements one torch element holds (2 for F4 as float4_e2m1fn_x2)."""
        return _torch()[self.name][1]

    def nbytes(self, numel: int) -> int | None:
        """Bytes that `numel` elements take, or None when they do not fill whole bytes."""
        bits = numel * self.bits
        return bits // 8 if bits % 8 == 0 else None


_TABLE: list[tuple[str, int, str, bool]] = [
    ("F64", 64, "float64", True),
    ("F32", 32, "float32", True),
    ("F16", 16, "float16", True),
    ("BF16", 16, "bfloat16", True),
    ("I64", 64, "int64", False),
    ("I32", 32, "int32", False),
    ("I16", 16, "int16", False),
    ("I8", 8, "int8", False),
    ("U64", 64, "uint64", False),
    ("U32", 32, "uint32", False),
    ("U16", 16, "uint16", False),
    ("U8", 8, "uint8", False),
    ("BOOL", 8, "bool", False),
    ("C64", 64, "complex64", False),
    ("F8_E4M3", 8, "float8_e4m3fn", False),
    ("F8_E5M2", 8, "float8_e5m2", False),
    ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", False),
    ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", False),
    ("F8_E8M0", 8, "float8_e8m0fnu", False),
    ("F6_E2M3", 6, "", False),
    ("F6_E3M2", 6, "", False),
    ("F4", 4, "float4_e2m1fn_x2", False),
]

DTYPES: dict[str, DType] = {name: DType(name, bits, td, fl) for name, bits, td, fl in _TABLE}
_TORCH_SIDE: dict[str, tuple[torch.dtype | None, int]] = {}


def _torch() -> dict[str, tuple[torch.dtype | None, int]]:
    """name -> (this torch's dtype or None, elements per torch element), made once (it is asked per tensor)."""
    if not _TORCH_SIDE:
        import torch

        made = {}
        for name, bits, torch_name, _ in _TABLE:
            td = getattr(torch, torch_name, None) if torch_name else None
            td = td if isinstance(td, torch.dtype) else None
            made[name] = (td, 1 if td is None else max(1, td.itemsize * 8 // bits))
        _TORCH_SIDE.update(made)  # whole, at once: another thread sees it empty or complete
    return _TORCH_SIDE


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
    import torch

    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise UnsupportedError(
            f"dtype={value!r} is not a torch dtype: pass one (torch.float16) or its name ('float16', 'bfloat16', "
            "'float32')"
        )
    return found
