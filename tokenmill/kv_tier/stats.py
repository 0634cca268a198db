"""Counters of the second KV tier, cumulative since the engine started."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVTierStats:
    capacity_blocks: int = 0  # blocks the tier holds at most (--kv-offloading-size)
    num_blocks: int = 0  # blocks in the tier now
    hit_tokens: int = 0  # prompt tokens served from the tier (loaded, not recomputed)
    blocks_loaded: int = 0  # blocks read back into the pool
    load_failures: int = 0  # blocks missing, truncated or corrupt when loaded: a miss, recomputed
    blocks_saved: int = 0  # blocks written to the tier
    blocks_dropped: int = 0  # evicted blocks not saved: the writer was behind (the step never waits)
    bytes_written: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0  # time spent reading blocks and copying them into the pool (in the step)
    loads: int = 0  # tier lookups that read blocks (one per admitted request whose prefix was there)
