"""KV layer groups (ARCHITECTURE.md decision 12): layers that attend alike share block tables and
block accounting. Group 0 holds the full-attention layers; each sliding-window size gets a group of
its own, whose blocks behind the window are freed as requests advance (scheduling/window_group.py).
A leaf module (the standard library only): the engine, the scheduler and the model runner read it.

A model without window layers has one group, and every path is the one it had before groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UNBOUNDED = 2**62  # a block count no budget limits (the caller caps it)


@dataclass(frozen=True)
class KVGroupSpec:
    windows: tuple[int, ...]  # groups 1, 2, ...: their sliding windows (group 0: full attention)
    layer_groups: tuple[int, ...]  # per layer: its group

    @classmethod
    def of_layers(cls, layer_windows: Sequence[int | None]) -> KVGroupSpec:
        """From each layer's sliding window (None: full attention)."""
        windows: list[int] = []
        for window in layer_windows:
            if window is not None and window not in windows:
                windows.append(window)
        return cls(tuple(windows), tuple(0 if w is None else 1 + windows.index(w) for w in layer_windows))

    @property
    def num_groups(self) -> int:
        return 1 + len(self.windows)

    def layer_counts(self) -> list[int]:
        return [self.layer_groups.count(g) for g in range(self.num_groups)]

    def pool_blocks(self, num_blocks: int, sized_by_memory: bool, limits: GroupLimits) -> list[int]:
        """Each group's pool: `num_blocks` for group 0; a window group as many when the count was
        given explicitly, else no more than it can ever hold at once (window_group_cap)."""
        if not sized_by_memory:
            return [num_blocks] * self.num_groups
        return [num_blocks] + [min(num_blocks, limits.window_group_cap(w)) for w in self.windows]


@dataclass(frozen=True)
class GroupLimits:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int

    def window_group_cap(self, window: int) -> int:
        """The most blocks a window group holds at once: each running request keeps the blocks of its
        last window - 1 tokens and of this step's (rounded out to whole blocks: +2, and a draft model's
        lookahead: +1), and a step's new tokens number at most max_num_batched_tokens."""
        bs = self.block_size
        return self.max_num_seqs * (-(-(window - 1) // bs) + 3) + -(-self.max_num_batched_tokens // bs)


def budget_num_blocks(budget_bytes: int, bytes_per_block: Sequence[int], caps: Sequence[int | None]) -> int:
    """The most group-0 blocks N for which sum over groups of min(N, cap) * bytes_per_block fits the
    budget (caps[0] is None: group 0 takes N)."""
    fixed = 0  # bytes of the groups whose cap N already passes
    per_n = sum(bytes_per_block)  # bytes per unit of N of the groups still growing with it
    for cap, size in sorted(((c, b) for c, b in zip(caps, bytes_per_block) if c is not None), key=lambda x: x[0]):
        n = (budget_bytes - fixed) // per_n
        if n <= cap:
            return max(n, 0)
        fixed += cap * size
        per_n -= size
    if per_n == 0:  # group 0 has no layers (every layer windowed): its blocks cost nothing
        return UNBOUNDED if fixed <= budget_bytes else 0
    return max((budget_bytes - fixed) // per_n, 0)
