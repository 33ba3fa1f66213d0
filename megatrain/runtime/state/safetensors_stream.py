"""safetensors files read and written a bounded chunk at a time, so that moving a model's weights between the host
store and disk takes :data:`CHUNK_BYTES`-sized buffers beside the store, never a second copy of the model.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header (an
optional ``__metadata__`` object of strings, then per tensor its dtype, shape and ``[begin, end)`` byte offsets into
the data that follows), padded with spaces to a multiple of 8 bytes, then the tensors' bytes. :func:`write` lays a
file out exactly as ``safetensors.torch.save_file`` does (tensors ordered by dtype, the wider first, then by name),
so the bytes are the same; :func:`read_header` and :func:`read_into` read with plain reads (no memory map, whose
pages would count as the process's own while mapped).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megatrain.layout import IO_CHUNK_BYTES

# bytes moved per read or write: large enough that a disk streams at its rate, small beside any model's store
# (what a load, an export or a save holds beyond the store is one or two of these: cost.STAGE_HOST_BYTES)
CHUNK_BYTES = IO_CHUNK_BYTES
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
# the dtypes megatrain reads and writes, by their names in the format, in the format's own order (a file lists its
# tensors by dtype from the last of these to the first, then by name)
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "F16": torch.float16,
          "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64}
_ORDER = list(DTYPES)
NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its dtype's name, shape and bytes ``[begin, end)`` from the file's start."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: str | Path) -> tuple[dict[str, str], dict[str, Entry]]:
    """(the metadata, the tensors by name) of the safetensors file ``path``, checked against the file's size: every
    tensor's bytes inside the file and of its shape's size. ValueError naming the file and the problem."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{path} is not a whole safetensors file (a header of "
                                 f"{'no' if n is None else f'{n:,}'} bytes in a file of {size:,})")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is not a whole safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a whole safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    data = 8 + n
    out = {}
    for name, t in header.items():
        try:
            dtype, shape, (lo, hi) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            ok = (dtype in DTYPES and all(isinstance(s, int) and s >= 0 for s in shape)
                  and isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= size - data)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: tensor {name!r} is not described as a safetensors tensor this megatrain "
                             f"reads ({t!r:.200}; dtypes {', '.join(DTYPES)})")
        entry = Entry(name, dtype, shape, data + lo, data + hi)
        if hi - lo != entry.numel * entry.torch_dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r} of shape {list(shape)} and dtype {dtype} takes "
                             f"{entry.numel * entry.torch_dtype.itemsize:,} bytes, its offsets give {hi - lo:,}")
        out[name] = entry
    return meta, out


def chunk_buffer() -> torch.Tensor:
    """A buffer of :data:`CHUNK_BYTES` for :func:`read_into` (one per thread that reads)."""
    return torch.empty(CHUNK_BYTES, dtype=torch.uint8)


def read_into(f, entry: Entry, dest: torch.Tensor, buf: torch.Tensor) -> None:
    """Read ``entry`` from the open file ``f`` into ``dest`` (a contiguous tensor of its size, any dtype: the
    values are cast), a chunk of ``buf`` (:func:`chunk_buffer`) at a time."""
    flat = dest.view(-1)
    if flat.numel() != entry.numel:
        raise ValueError(f"{entry.name}: {entry.numel} elements into a tensor of {flat.numel()}")
    item = entry.torch_dtype.itemsize
    step = buf.numel() // item
    view = memoryview(buf.numpy())
    fd = f.fileno()
    for lo in range(0, entry.numel, step):
        k = min(step, entry.numel - lo) * item
        got = os.preadv(fd, [view[:k]], entry.begin + lo * item)
        if got != k:
            raise ValueError(f"{getattr(f, 'name', 'the file')}: tensor {entry.name!r} ends early (read {got} of "
                             f"{k} bytes at {entry.begin + lo * item:,}): a cut file")
        flat[lo: lo + k // item].copy_(buf[:k].view(entry.torch_dtype))


class Source(Protocol):
    """What :func:`write` takes for a tensor besides a ``torch.Tensor``: its shape, and its elements in row-major
    order a slice at a time (``src[lo:hi]``, a 1-D tensor)."""
    shape: tuple[int, ...]

    def __getitem__(self, s: slice) -> torch.Tensor: ...


def layout(tensors: dict[str, "torch.Tensor | Source"], dtype: torch.dtype,
           metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[str, int]]]:
    """The header bytes (length prefix included) of a file of ``tensors`` all in ``dtype``, and the tensors in
    the order their bytes follow it, each with its element count: as ``safetensors.torch.save_file`` writes them."""
    if dtype not in NAMES:
        raise ValueError(f"safetensors: dtype {dtype} is not one of {', '.join(map(str, NAMES))}")
    order = sorted(tensors, key=lambda k: (-_ORDER.index(NAMES[dtype]), k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off, counts = 0, []
    for name in order:
        shape = [int(s) for s in tensors[name].shape]
        n = math.prod(shape)
        header[name] = {"dtype": NAMES[dtype], "shape": shape, "data_offsets": [off, off + n * dtype.itemsize]}
        off += n * dtype.itemsize
        counts.append((name, n))
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, counts


def nbytes(tensors: dict[str, "torch.Tensor | Source"], dtype: torch.dtype) -> int:
    """Bytes of the file :func:`write` makes of ``tensors`` in ``dtype``."""
    head, counts = layout(tensors, dtype, {"format": "pt"})
    return len(head) + sum(n for _, n in counts) * dtype.itemsize


def write(f, tensors: dict[str, "torch.Tensor | Source"], dtype: torch.dtype,
          metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (any dtype; cast to ``dtype`` a chunk at a time) as a safetensors file into the open
    binary file ``f``; returns the bytes written. Memory beyond the tensors: one chunk in the source's dtype (a
    :class:`Source` reads it) and one in ``dtype``."""
    head, counts = layout(tensors, dtype, metadata)
    f.write(head)
    total = len(head)
    step = CHUNK_BYTES // 4
    for name, n in counts:
        src = tensors[name]
        flat = src.detach().reshape(-1) if isinstance(src, torch.Tensor) else src
        for lo in range(0, n, step):
            out = flat[lo: min(n, lo + step)].to(dtype).contiguous()  # (no copy where the dtype is the file's)
            f.write(memoryview(out.view(torch.uint8).numpy()))
            total += out.numel() * dtype.itemsize
    return total
