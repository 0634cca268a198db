"""The second KV tier: full prefix blocks evicted from the KV pool are kept in a larger, slower store (a
file per block on CPU, pinned host memory behind a GPU) and loaded back into free pool blocks on a hit.

The scheduler keeps the index (index.py: which block hashes the tier holds, LRU); each step's
SchedulerOutput names the blocks to save and to load, and the model runner moves their bytes
(store.py, writer.py: saves are written by a thread, never in the step's critical path)."""
