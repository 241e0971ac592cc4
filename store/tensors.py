"""Tensors and numpy arrays as raw bytes: names for dtypes, byte views, empty outputs.

A tensor is stored as the bytes of its contiguous values; a non-contiguous view is stored as
its values, a CUDA tensor is copied to host memory, a conjugate or negative view is resolved.
"""

from __future__ import annotations

import ctypes

import functools

import numpy as np

from cas.errors import CorruptionError

from .lazytorch import torch
from .values import numpy_dtype

# Every torch dtype whose elements are plain bytes (quantized dtypes carry scales elsewhere and
# are refused), by name: (bytes per element, byte-group stride: a float component's size, 0 for
# non-floats). A table rather than torch's own answers, so that a manifest is read, checked, listed,
# verified and collected without importing torch (tests/test_layers.py checks it against torch).
TORCH_DTYPE_LAYOUT: dict[str, tuple[int, int]] = {
    "float32": (4, 4), "float64": (8, 8), "float16": (2, 2), "bfloat16": (2, 2),
    "complex32": (4, 2), "complex64": (8, 4), "complex128": (16, 8),
    "int8": (1, 0), "int16": (2, 0), "int32": (4, 0), "int64": (8, 0),
    "uint8": (1, 0), "uint16": (2, 0), "uint32": (4, 0), "uint64": (8, 0), "bool": (1, 0),
    "float8_e4m3fn": (1, 1), "float8_e5m2": (1, 1), "float8_e4m3fnuz": (1, 1), "float8_e5m2fnuz": (1, 1),
    "float8_e8m0fnu": (1, 1), "float4_e2m1fn_x2": (1, 1), "bits8": (1, 0), "bits16": (2, 0),
}


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """The dtypes of TORCH_DTYPE_LAYOUT this torch has, by name (imports torch)."""
    return {name: getattr(torch, name) for name in TORCH_DTYPE_LAYOUT
            if isinstance(getattr(torch, name, None), torch.dtype)}


@functools.cache
def torch_dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in torch_dtypes().items()}


def __getattr__(name: str):
    """TORCH_DTYPES and TORCH_DTYPE_NAMES, the tables above as torch objects, on first use (PEP 562)."""
    if name == "TORCH_DTYPES":
        return torch_dtypes()
    if name == "TORCH_DTYPE_NAMES":
        return torch_dtype_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_layout(name: str) -> tuple[int, int]:
    """(element size, byte-group stride) of a torch dtype name; CorruptionError for a name that is
    not one (a manifest's dtype is checked here, without torch)."""
    try:
        return TORCH_DTYPE_LAYOUT[name]
    except (KeyError, TypeError):
        raise CorruptionError(f"unknown torch dtype {name!r}") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return torch_dtypes()[name]
    except KeyError:
        raise CorruptionError(f"unknown torch dtype {name!r}") from None


def is_floating(dtype) -> bool:
    """Floats and complex numbers: byte grouping helps (their high bytes repeat), and so do deltas."""
    if isinstance(dtype, np.dtype) or isinstance(dtype, str):
        return np.dtype(dtype).kind in "fc"
    return dtype.is_floating_point or dtype.is_complex


def group_size(dtype) -> int:
    """Byte-group stride for a dtype: the size of one float component (complex64 -> 4)."""
    if isinstance(dtype, np.dtype) or isinstance(dtype, str) or isinstance(dtype, type):
        dtype = np.dtype(dtype)
        return dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    size = dtype.itemsize
    return size // 2 if dtype.is_complex else size


def unsupported_tensor_reason(t: torch.Tensor) -> str | None:
    if t.layout != torch.strided:
        return f"tensor layout {t.layout} (only dense tensors are stored)"
    if t.dtype not in torch_dtype_names():
        return f"tensor dtype {t.dtype}"
    if t.device.type == "meta":
        return "a meta tensor (it has no data)"
    if t.is_nested:
        return "a nested tensor"
    return None


def torch_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's contiguous values as a flat uint8 numpy array: a view when the tensor is
    already a contiguous CPU tensor, else one copy."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous() and (same_size := same_size_int(t.element_size())) is not None:
        # reinterpret first: torch cannot copy some dtypes (float4, bits) into a contiguous layout
        t = t.view(same_size)
    return numpy_view(flat_bytes(t.contiguous()))


def numpy_view(flat: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a flat uint8 CPU tensor's memory, keeping the tensor
    alive. Not `.numpy()`: that marks the storage as never resizable again, so a user's tensor
    that was saved or restored into could no longer grow with resize_ (torch 2.13)."""
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    memory = (ctypes.c_uint8 * flat.numel()).from_address(flat.data_ptr())
    memory.owner = flat  # the numpy array holds `memory`, which holds the tensor
    return np.frombuffer(memory, dtype=np.uint8)


def same_size_int(size: int) -> torch.dtype | None:
    """The integer dtype of `size` bytes, to reinterpret a tensor's elements as."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor sharing its memory."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    if flat.stride(0) != 1:  # one element with an odd stride still counts as contiguous
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def numpy_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def empty_torch(dtype_name: str, shape: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh CPU tensor and a writable uint8 view of its bytes."""
    t = torch.empty(shape, dtype=torch_dtype(dtype_name), device="cpu")  # (whatever torch.set_default_device says)
    return t, numpy_view(flat_bytes(t))


def empty_numpy(dtype_str: str, shape: list[int]) -> tuple[np.ndarray, np.ndarray]:
    a = np.empty(shape, dtype=numpy_dtype(dtype_str))
    return a, a.reshape(-1).view(np.uint8)


def nbytes_of(dtype_size: int, shape: list[int]) -> int:
    n = dtype_size
    for d in shape:
        n *= d
    return n


def element_size(lib: str, dtype_name: str) -> int:
    if lib == "torch":
        return torch_layout(dtype_name)[0]
    return numpy_dtype(dtype_name).itemsize


def without_shared_memory(targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The restore targets minus each one whose bytes overlap an earlier one's. Two state-dict
    entries can be one tensor (tied weights) or views of one storage, and two decodes must never
    write the same bytes at once: a chain decode keeps its intermediate levels in its output.
    A target left out gets a new tensor, which load_state_dict copies into the shared memory."""
    spans = sorted((t.data_ptr(), order, t.data_ptr() + t.numel() * t.element_size(), path)
                   for order, (path, t) in enumerate(targets.items())
                   if t.device.type == "cpu" and t.layout == torch.strided and t.numel() and t.is_contiguous())
    overlapping, reach = set(), 0
    for start, _, end, path in spans:
        if start < reach:
            overlapping.add(path)
        reach = max(reach, end)
    return {path: t for path, t in targets.items() if path not in overlapping}


def output_for(node: dict, dest=None) -> tuple[object, np.ndarray]:
    """Where a loaded tensor's bytes go: `dest` itself when it is a CPU tensor of the node's
    dtype and shape laid out contiguously (restore into an existing model), else a new one."""
    if node["lib"] == "numpy":
        return empty_numpy(node["dtype"], node["shape"])
    dtype = torch_dtype(node["dtype"])
    if (isinstance(dest, torch.Tensor) and dest.device.type == "cpu" and dest.layout == torch.strided
            and dest.dtype == dtype and list(dest.shape) == node["shape"] and dest.is_contiguous() and dest.numel()
            and not dest.is_conj() and not dest.is_neg()):
        return dest, numpy_view(flat_bytes(dest))
    return empty_torch(node["dtype"], node["shape"])
