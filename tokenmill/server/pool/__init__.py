"""Several models behind one server: requests pick one by their `model` field (`name@version`, an alias,
a bare name, or an --extra-model's name), each loaded model runs its own engine, loaded on first use and
unloaded when idle or evicted for room.

    catalog.py   what can be served (the registry's versions and aliases, --extra-model folders)
    pool.py      the loaded engines: load on demand, leases, drain, keep-alive, LRU eviction, budgets
    estimate.py  a model's expected memory (weights + KV cache), for the budget
    access.py    which models each API key may use (access.json)
    quota.py     how many loads each API key may start per hour
    admin.py     /admin/...: load, unload, move an alias (behind --admin-key)
    listing.py   /v1/models with versions, aliases and states
    metrics.py   load/unload times, resident models, and one /metrics page for every engine
    setup.py     the server state with its pool
"""
