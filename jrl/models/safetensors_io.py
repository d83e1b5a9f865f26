"""Read and write the safetensors format with numpy + ml_dtypes, bfloat16 included.

safetensors' own numpy loader rejects bfloat16, and going through torch or flax would add a
dependency or a device copy. The format is simple (an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, then the raw little-endian bytes), so
we read it with a memory map and write it directly. Every inconsistency raises an error naming
the file and tensor.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

# safetensors dtype tag -> numpy dtype (all little-endian).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}
_TAG_OF_DTYPE = {dtype: tag for tag, dtype in SAFETENSORS_DTYPES.items()}

# Headers above this size are not produced by any writer we know; reading one is a sign of a
# corrupt or non-safetensors file.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFile:
    """Lazy reader of one .safetensors file: the header is parsed on open, tensors on demand.

    `shapes` maps tensor name -> shape tuple; `read(name)` returns a numpy array (a read-only
    view into the memory map; copy it before mutating).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        file_size = os.path.getsize(self.path)
        with open(self.path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise ValueError(f"{self.path}: not a safetensors file or truncated (header "
                                 f"length {header_len} bytes, file size {file_size} bytes)")
            try:
                header = json.loads(handle.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{self.path}: safetensors header is not valid JSON: {error}")
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        data_size = file_size - self._data_start
        for name, entry in header.items():
            tag = entry.get("dtype")
            if tag not in SAFETENSORS_DTYPES:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {tag!r}; supported: "
                                 f"{sorted(SAFETENSORS_DTYPES)}")
            dtype = SAFETENSORS_DTYPES[tag]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(o) for o in entry["data_offsets"])
            expected_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - start != expected_bytes:
                raise ValueError(f"{self.path}: tensor {name!r} ({tag} {list(shape)}) needs "
                                 f"{expected_bytes} bytes but its data_offsets span {end - start}")
            if end > data_size:
                raise ValueError(f"{self.path}: truncated; tensor {name!r} ends at byte {end} of "
                                 f"the data section, which has only {data_size} bytes")
            self._entries[name] = (dtype, shape, start, end)
        self._memmap: np.memmap | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: entry[1] for name, entry in self._entries.items()}

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name][0]

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def read(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        dtype, shape, start, end = self._entries[name]
        if self._memmap is None:
            self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._memmap[self._data_start + start:self._data_start + end]
        return raw.view(dtype).reshape(shape)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], *,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (name -> numpy array) to `path` in the safetensors format.

    Tensors are laid out in the given order; the header is padded with spaces to a multiple of 8
    bytes (as the reference writer does) so every tensor's data is 8-byte aligned.
    """
    header: dict[str, dict] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        tag = _TAG_OF_DTYPE.get(np.dtype(array.dtype))
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot be stored in "
                             f"safetensors; supported: {sorted(SAFETENSORS_DTYPES)}")
        header[name] = {"dtype": tag, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header_bytes)))
        handle.write(header_bytes)
        for array in arrays:
            handle.write(array.tobytes())
        handle.flush()
        os.fsync(handle.fileno())


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Groups tensor names, in order, into shards of at most max_shard_bytes each.

    A tensor larger than max_shard_bytes gets a shard of its own (it cannot be split).
    """
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards
