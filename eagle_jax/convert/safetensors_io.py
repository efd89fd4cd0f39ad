"""Minimal, dependency-free safetensors reader and writer on numpy.

`safetensors.safe_open(..., framework="numpy")` cannot return bfloat16 (numpy
has no such dtype), so the converters read the format directly: an 8-byte
little-endian header length, a JSON header, then the raw tensor bytes. Arrays
come back as read-only memory-mapped views (`ml_dtypes.bfloat16` for BF16), so
opening a file costs nothing until a tensor is touched. The writer produces
files that `safetensors.safe_open` reads back (tested).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file is malformed or uses an unsupported dtype."""


class SafetensorsFile(Mapping):
    """Read-only mapping name -> np.ndarray (memory-mapped, little-endian)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{self.path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{self.path}: bad header length {n} (file size {size})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsError(f"{self.path}: header is not valid JSON ({e})") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        data_len = size - self._base
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            code = info.get("dtype")
            if code not in _DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {code!r}")
            dtype = _DTYPES[code]
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - start != expected or end > data_len or start < 0:
                raise SafetensorsError(
                    f"{self.path}: tensor {name!r} offsets {start}..{end} do not fit "
                    f"shape {list(shape)} {code} in {data_len} data bytes"
                )
            self._entries[name] = (dtype, shape, start, end)
        self._mm: np.memmap | None = None

    def _map(self) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape, start, end = self._entries[name]
        if start == end:
            return np.zeros(shape, dtype)
        buf = self._map()[self._base + start:self._base + end]
        return buf.view(dtype.newbyteorder("<")).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name][0]


def save_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (numpy or anything `np.asarray` accepts) to `path`."""
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, a in arrays.items():
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"cannot store tensor {name!r} of dtype {a.dtype}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            if a.dtype.byteorder == ">":
                a = a.astype(a.dtype.newbyteorder("<"))
            f.write(a.reshape(-1).view(np.uint8).data)
