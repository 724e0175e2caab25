"""Arrays of the caller's kind: recognising them, shaping them for the library, allocating outputs.

The library takes arrays of rank 0, 1 or 2 with a contiguous last dimension. Everything here
keeps the caller's memory where it is: a view is passed whenever one exists, and an input is
copied only when its layout cannot be described (a transposed or strided last dimension).
Outputs are allocated as the caller's kind of array (NumPy in, NumPy out; PyTorch in, PyTorch
out, on the same device); any other array that speaks DLPack is viewed through NumPy (host
memory) or PyTorch (CUDA memory) and its results handed back through its own namespace.
"""

from __future__ import annotations

import math
import sys

import numpy as np

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")
MASK_DTYPES = ("bool", "uint8")

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3
_DLPACK_CUDA_MANAGED = 13


def _torch():
    """PyTorch if the program has imported it; never imported from here."""
    return sys.modules.get("torch")


def _is_torch_tensor(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


class Array:
    """One argument: the array the library sees (`data`, a NumPy array or a torch tensor), the
    namespace it belongs to, and how results go back to the caller's kind."""

    __slots__ = ("name", "data", "kind", "back")

    def __init__(self, name, data, kind, back):
        self.name = name
        self.data = data
        self.kind = kind  # "numpy" or "torch"
        self.back = back  # converts a result of `kind` to the caller's kind

    # ---- properties, uniform across kinds ----
    @property
    def shape(self):
        return tuple(self.data.shape)

    @property
    def ndim(self):
        return len(self.data.shape)

    @property
    def dtype(self) -> str:
        if self.kind == "numpy":
            return self.data.dtype.name
        return str(self.data.dtype).replace("torch.", "")

    @property
    def device(self) -> int:
        """-1 for host memory, else the CUDA ordinal."""
        if self.kind == "numpy":
            return -1
        dev = self.data.device
        return -1 if dev.type == "cpu" else dev.index

    def device_name(self) -> str:
        return "cpu" if self.device < 0 else f"cuda:{self.device}"

    # ---- shaping ----
    def rows(self):
        """This array as a rank-2 (rows, last dimension) view the library can describe."""
        d = self.data
        return _describable(d.reshape(math.prod(d.shape[:-1]), d.shape[-1]), self.kind)

    def flat(self):
        """This array as a rank-1 contiguous vector."""
        return _describable(self.data.reshape(-1), self.kind)


def _describable(d, kind):
    """d itself when its layout has a positive row stride and a unit last stride, else a copy."""
    if kind == "numpy":
        item = d.itemsize
        strides = d.strides
        ok = all(s % item == 0 for s in strides)
        if ok and d.ndim >= 1 and d.shape[-1] > 1 and strides[-1] != item:
            ok = False
        if ok and d.ndim == 2 and d.shape[0] > 1 and strides[0] < d.shape[1] * item:
            ok = False
        if ok and d.ndim == 1 and d.shape[0] > 1 and strides[0] != item:
            ok = False
        return d if ok else np.ascontiguousarray(d)
    strides = d.stride()
    ok = True
    if d.ndim >= 1 and d.shape[-1] > 1 and strides[-1] != 1:
        ok = False
    if ok and d.ndim == 2 and d.shape[0] > 1 and strides[0] < d.shape[1]:
        ok = False
    return d if ok else d.contiguous()


def check_not_sharded(x, name: str) -> None:
    """Raises TypeError for a DTensor: its memory holds a shard (or none), not the tensor."""
    torch = _torch()
    dtensor = getattr(getattr(getattr(torch, "distributed", None), "tensor", None), "DTensor", None)
    if dtensor is not None and isinstance(x, dtensor):
        raise TypeError(
            f"{name}: a DTensor (sharded, as by FSDP or tensor parallelism); lmloss needs the "
            "whole tensor: under FSDP call the loss inside the forward of the module that owns "
            "the head, where FSDP has gathered its weight"
        )


def as_array(x, name: str) -> Array:
    """Recognises one array argument, or raises TypeError naming it."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf" or not x.dtype.isnative:
            hint = (" (NumPy has no bfloat16 of its own to export: pass a torch.bfloat16 tensor, "
                    "or float32)" if x.dtype.name == "bfloat16" else "")
            order = "" if x.dtype.isnative else ", not in the machine's byte order,"
            raise TypeError(f"{name}: a NumPy array of dtype {x.dtype.name}{order} cannot cross "
                            f"DLPack{hint}")
        return Array(name, x, "numpy", _identity)
    if _is_torch_tensor(x):
        check_not_sharded(x, name)
        # Autograd is the torch layer's business; the raw call reads and writes memory only.
        return Array(name, x.detach(), "torch", _identity)
    if isinstance(x, np.generic):
        return Array(name, np.asarray(x), "numpy", _identity)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type, device_id = x.__dlpack_device__()
        back = _namespace_back(x)
        try:
            if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
                return Array(name, np.from_dlpack(x), "numpy", back)
            if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
                torch = _torch()
                if torch is None:
                    try:
                        import torch  # noqa: F811  (CUDA arrays of other kinds are allocated through it)
                    except ImportError:
                        raise TypeError(
                            f"{name}: CUDA arrays other than PyTorch tensors need PyTorch installed"
                        ) from None
                return Array(name, torch.from_dlpack(x), "torch", back)
        except (TypeError, BufferError, RuntimeError) as e:
            raise TypeError(f"{name}: cannot view this {type(x).__name__} through DLPack: {e}") from None
        raise ValueError(f"{name}: arrays on DLPack device type {device_type} are not supported")
    raise TypeError(
        f"{name}: expected an array (NumPy, PyTorch or any object with __dlpack__), "
        f"got {type(x).__name__}"
    )


def _identity(a):
    return a


def _namespace_back(x):
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        return _identity
    xp = namespace()
    return getattr(xp, "from_dlpack", _identity)


def empty(like: Array, shape, dtype: str):
    """An uninitialised array of like's kind and device."""
    if like.kind == "numpy":
        return np.empty(shape, dtype=dtype)
    torch = _torch()
    return torch.empty(shape, dtype=getattr(torch, dtype), device=like.data.device)


def float32_over(block, shape):
    """A float32 PyTorch tensor of `shape` over the bytes of `block` (a tensor of at least as many
    bytes): a tensor of its own over block's storage, not a view; block may be dropped."""
    torch = _torch()
    out = torch.empty(0, dtype=torch.float32, device=block.device)
    offset = block.storage_offset() * block.element_size() // 4  # in float32 elements
    return out.set_(block.untyped_storage(), offset, tuple(shape), (shape[1], 1))


def to_float(scalar, kind: str) -> float:
    """A 0-d result as a Python float (on CUDA this waits for the result)."""
    if kind == "numpy":
        return float(scalar)
    return float(scalar.item())
