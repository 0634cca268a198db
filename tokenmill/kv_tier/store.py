"""Where the second KV tier keeps its blocks: a file per block (CPU: it outlives the process), or host
memory (behind a GPU). A payload is a block's KV as one flat uint8 tensor (worker/kv_tier_io.py).

A block file is a header, then the payload: magic, format version, the block's 32-byte hash, the payload
size and its CRC-32. A load checks all of them, so a missing, truncated, renamed or damaged file is a
miss (logged, and deleted), never wrong KV."""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

MAGIC = b"TMKV"
VERSION = 1
HASH_BYTES = 32
# magic, version, hash, payload bytes, crc32 of the payload
_HEADER = struct.Struct(f"<4sI{HASH_BYTES}sQI")
SUFFIX = ".kvb"


class BlockStore(Protocol):
    persistent: bool  # outlives the process: worth saving the KV cache's prefixes into at shutdown

    def put(self, block_hash: bytes, payload: torch.Tensor) -> int:
        """Store a block's payload (1-D uint8, contiguous, on the CPU); the bytes written."""
        ...

    def get(self, block_hash: bytes, nbytes: int) -> torch.Tensor | None:
        """The block's payload, or None when it is missing or fails its checks."""
        ...

    def delete(self, block_hash: bytes) -> None: ...

    def contains(self, block_hash: bytes) -> bool:
        """Whether a block of this hash is stored (unchecked: a get still checks it)."""
        ...

    def hashes(self) -> list[bytes]:
        """Every stored block, oldest first."""
        ...

    def clear(self) -> None: ...


class FileBlockStore:
    persistent = True

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for stray in folder.glob(f"*/*{SUFFIX}.tmp*"):  # a writer killed mid-write
            stray.unlink(missing_ok=True)

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    def put(self, block_hash: bytes, payload: torch.Tensor) -> int:
        data = payload.numpy().data
        header = _HEADER.pack(MAGIC, VERSION, block_hash, len(data), zlib.crc32(data))
        path = self._path(block_hash)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)  # a reader sees the whole block or none
        return len(header) + len(data)

    def get(self, block_hash: bytes, nbytes: int) -> torch.Tensor | None:
        path = self._path(block_hash)
        payload = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                got = f.readinto(payload.numpy().data) if len(header) == _HEADER.size else 0
                extra = f.read(1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            problem: str | None = f"unreadable ({exc})"
        else:
            problem = _check(header, block_hash, nbytes, got, extra, payload)
        if problem is None:
            return payload
        logger.warning("KV tier block %s is unusable (%s): a miss, recomputed; deleting it", path, problem)
        path.unlink(missing_ok=True)
        return None

    def delete(self, block_hash: bytes) -> None:
        self._path(block_hash).unlink(missing_ok=True)

    def contains(self, block_hash: bytes) -> bool:
        return self._path(block_hash).is_file()

    def hashes(self) -> list[bytes]:
        found = []
        for path in self.folder.glob(f"*/*{SUFFIX}"):
            try:
                found.append((path.stat().st_mtime_ns, bytes.fromhex(path.name[: -len(SUFFIX)])))
            except (OSError, ValueError):
                continue  # deleted meanwhile, or not one of ours
        return [h for _, h in sorted(found)]

    def clear(self) -> None:
        for path in self.folder.glob(f"*/*{SUFFIX}"):
            path.unlink(missing_ok=True)


def _check(header: bytes, block_hash: bytes, nbytes: int, got: int, extra: bytes, payload: torch.Tensor) -> str | None:
    """What is wrong with a block file read as `header`, `got` payload bytes and `extra` bytes after, if anything."""
    if len(header) < _HEADER.size:
        return "truncated header"
    magic, version, stored_hash, size, crc = _HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        return f"not a version-{VERSION} block file"
    if stored_hash != block_hash:
        return "holds another block's hash"
    if size != nbytes or got != nbytes or extra:
        return f"{size} payload bytes recorded, {got}{'+' if extra else ''} read, {nbytes} expected"
    if zlib.crc32(payload.numpy().data) != crc:
        return "checksum mismatch"
    return None


class HostBlockStore:
    """Blocks in host memory (pinned when CUDA is there, so copies to the GPU run at full speed)."""

    persistent = False

    def __init__(self) -> None:
        self._blocks: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._pin = torch.cuda.is_available()

    def put(self, block_hash: bytes, payload: torch.Tensor) -> int:
        copy = payload.pin_memory() if self._pin else payload.clone()
        with self._lock:
            self._blocks[block_hash] = copy
        return copy.numel()

    def get(self, block_hash: bytes, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            payload = self._blocks.get(block_hash)
        if payload is not None and payload.numel() != nbytes:
            logger.warning(
                "KV tier block %s holds %d bytes, %d expected: a miss", block_hash.hex(), payload.numel(), nbytes
            )
            self.delete(block_hash)
            return None
        return payload

    def delete(self, block_hash: bytes) -> None:
        with self._lock:
            self._blocks.pop(block_hash, None)

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
