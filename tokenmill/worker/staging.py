"""Host arrays to the device for a step's inputs: on CUDA through pinned memory with non-blocking copies
(a pageable `torch.tensor(list, device="cuda")` blocks the host until the copy is done, every tensor of
every step); on CPU the arrays themselves, without a copy.

A step's arrays are packed into one pinned arena; two arenas take turns, one step each, so a step's
copies may still be in flight while the next step packs its own. (An arena is packed again two steps
later, by which time the engine has collected the step that used it (async scheduling collects step N
before it builds step N + 2), so its copies are done and a third would never be needed.)"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64  # bytes: each array starts on its own cache line


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._arenas: list[torch.Tensor] = []  # [2] pinned uint8, CUDA only
        self._turn = 0
        self._used = 0

    def begin_step(self) -> None:
        """The next step's arrays go to the other arena."""
        self._turn ^= 1
        self._used = 0

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` (contiguous) as a tensor on the device; on CPU it shares the array's memory."""
        if self.device.type != "cuda":
            return torch.from_numpy(array)
        array = np.ascontiguousarray(array)
        start = -(-self._used // _ALIGN) * _ALIGN
        end = start + array.nbytes
        if not self._arenas or end > self._arenas[0].numel():
            self._grow(end)
        self._used = end
        pinned = self._arenas[self._turn][start:end]
        pinned.numpy()[...] = array.view(np.uint8).reshape(-1)
        host = pinned.view(torch.from_numpy(array[:0]).dtype).view(array.shape)  # the array's dtype
        return host.to(self.device, non_blocking=True)

    def _grow(self, nbytes: int) -> None:
        """Bigger arenas (a step of more tokens or requests than any before). Copies still reading
        the old ones keep them: PyTorch's pinned allocator frees a block only after its copies."""
        size = max(nbytes, 2 * (self._arenas[0].numel() if self._arenas else 1 << 16))
        self._arenas = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
