"""GET /v1/models with a pool: every id a client may send (the default model, each `name@version`, bare
names, aliases), with what it resolves to and that version's state. A key sees only what it may use."""

from __future__ import annotations

from tokenmill.server.pool.catalog import ModelEntry
from tokenmill.server.pool.pool import ModelPool, ModelStatus
from tokenmill.server.protocol import ModelCard


class PooledModelCard(ModelCard):
    """OpenAI's model object plus where the id leads: `root` is the `name@version` it resolves to now."""

    name: str
    version: str | None = None
    aliases: list[str] = []
    state: ModelStatus


def model_cards(pool: ModelPool, key: str) -> list[PooledModelCard]:
    main = pool.main
    targets: list[tuple[str, ModelEntry]] = [(main.model_name, pool.lookup(None))]
    targets += pool.catalog.served_ids()
    aliases = pool.catalog.aliases()
    cards: list[PooledModelCard] = []
    for served_id, entry in targets:
        if pool.access is not None and not pool.access.allows(key, (served_id, entry.id, entry.name)):
            continue
        loaded = next((m for m in pool.loaded() if m.entry.id == entry.id), None)
        state = loaded.state if loaded is not None else None
        cards.append(
            PooledModelCard(
                id=served_id,
                root=entry.id,
                name=entry.name,
                version=entry.version,
                aliases=sorted(a for a, target in aliases.items() if target == entry.id),
                state=pool.status(entry.id),
                max_model_len=state.engine.max_model_len if state is not None else None,
            )
        )
    return cards
