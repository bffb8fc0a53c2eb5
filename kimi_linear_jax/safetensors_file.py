"""The safetensors file format, read lazily (memory-mapped, one tensor at a time) and written.

Owned here rather than through the `safetensors` package because bfloat16 must round-trip
through numpy (ml_dtypes), and because a truncated or malformed file must fail with a message
that names the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFormatError(ValueError):
    """A file that is not a readable safetensors file (bad header, truncated data)."""


class SafetensorsFile(Mapping):
    """name -> numpy array view of one file; arrays are read from a memory map on access."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(f"{self.path}: truncated (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SafetensorsFormatError(f"{self.path}: truncated header ({n} bytes declared)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsFormatError(f"{self.path}: unreadable header ({e})") from e
        if not isinstance(header, dict):
            raise SafetensorsFormatError(f"{self.path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._base = 8 + n
        self._data_size = size - self._base
        self._map: np.memmap | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise SafetensorsFormatError(
                f"{self.path}: {name}: unsupported dtype {entry.get('dtype')}"
            )
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end > self._data_size or end - start != int(np.prod(shape)) * dtype.itemsize:
            raise SafetensorsFormatError(
                f"{self.path}: {name}: data out of range (truncated file?): bytes {start}..{end} "
                f"of {self._data_size}"
            )
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self._base + start : self._base + end]
        return raw.view(dtype).reshape(shape)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: dict | None = None
) -> None:
    """Write name -> array (contiguous, little-endian) in sorted name order."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        a = tensors[name]
        if a.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data start to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
