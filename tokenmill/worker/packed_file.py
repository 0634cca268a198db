"""Read a safetensors file (https://github.com/huggingface/safetensors#format) straight into huge-page
memory: a copy from an mmapped file first faults in every 4 KiB page of it, several times slower than
the kernel's copy from its page cache (read(2)) into the destination."""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path

import torch

from tokenmill.ops import hugepages

ARENA = "arena"  # metadata key: the JSON list of the tensors that share the first arena, in its order
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, the header's metadata). The tensors metadata[ARENA] names lie in one huge-page arena in
    that order (hugepages.arena), the rest in a second. ValueError when the file is not a whole
    safetensors file."""
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise ValueError("not a safetensors file: its header would be longer than the file")
        header = json.loads(f.read(header_len))
        metadata: dict[str, str] = header.pop("__metadata__", {})
        start = 8 + header_len
        end = max((spec["data_offsets"][1] for spec in header.values()), default=0)
        if size != start + end:
            raise ValueError("the file's size does not match its header (a partial write?)")
        first = json.loads(metadata.get(ARENA, "[]"))
        rest = [name for name in header if name not in set(first)]
        tensors: dict[str, torch.Tensor] = {}
        for names in (first, rest):
            specs = [header[name] for name in names]
            slots = hugepages.arena([b - a for a, b in (spec["data_offsets"] for spec in specs)])
            for name, spec, slot in zip(names, specs, slots):
                f.seek(start + spec["data_offsets"][0])
                _read_into(f, slot)
                tensors[name] = slot.view(_DTYPES[spec["dtype"]]).view(spec["shape"])
    return tensors, metadata


def _read_into(f: io.FileIO, slot: torch.Tensor) -> None:
    """Fill `slot` from the file's position: read(2) into it, no copy in between (unbuffered)."""
    view = slot.numpy().data  # [nbytes] uint8
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError("the file ends early")
        done += n
