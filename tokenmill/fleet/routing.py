"""The routing policy, as plain Python (no Ray): which replica gets a request.

A request's prompt is cut into blocks of `block_chars` characters; each full block gets a key chained
on the previous one (sha256, seeded with the request's `cache_salt`), like the engine's KV-block keys
but over text, because the router runs before tokenization. The policy remembers which replicas were
sent each key. A new request goes to the replica that holds its longest prefix when that replica's
load is within `slack_tokens` of the least-loaded one (its KV cache probably still holds the prefix,
so the prompt costs less there), else to the least-loaded replica.

Load is counted in tokens: prompt + max_tokens (times n) of every request routed and not yet finished,
or what the replica itself last reported (queued and running tokens), whichever is larger: the first
is fresh but sees only this router's requests, the second sees everyone's but is a few seconds old."""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BLOCK_CHARS = 64  # about 16 tokens of English: the engine's KV block
MAX_PREFIX_BLOCKS = 32  # keys over the first 2048 characters; later blocks rarely change the choice
CHARS_PER_TOKEN = 4  # a rough estimate: the router never tokenizes
# A request's routing hints may name one replica instead (the admin calls sent to every replica): it
# goes there and nowhere else.
PIN_REPLICA = "replica"
ROLE = "role"  # in the stats the routers keep of each replica: its kv_role (both, prefill or decode)
DEFAULT_MAX_TOKENS = 256  # load counted for a request that gives no max_tokens


@dataclass(frozen=True)
class RoutingHints:
    """What the router knows of a request: its prefix keys (shortest prefix first) and its token load."""

    prefix_keys: tuple[str, ...]
    load_tokens: int
    prompt_tokens: int = 0  # estimated (of the first prompt of a batch)


@dataclass(frozen=True)
class Decision:
    replica: str
    affinity: bool  # sent to a replica that holds part of its prefix
    matched_blocks: int


def prefix_keys(
    prompt: str, cache_salt: str | None = None, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_PREFIX_BLOCKS
) -> tuple[str, ...]:
    """Chained keys of the prompt's full blocks: key i covers prompt[: (i + 1) * block_chars]. Two
    prompts share key i exactly when they share that prefix and their salt."""
    parent = hashlib.sha256(json.dumps(["salt", cache_salt]).encode()).hexdigest()
    keys = []
    for start in range(0, min(len(prompt) // block_chars, max_blocks) * block_chars, block_chars):
        # surrogatepass: a JSON string may hold a lone surrogate (\ud800), which strict UTF-8 refuses
        block = (parent + prompt[start : start + block_chars]).encode(errors="surrogatepass")
        parent = hashlib.sha256(block).hexdigest()
        keys.append(parent)
    return tuple(keys)


def hints_from_body(path: str, body: bytes, salt_extra: str | None = None) -> RoutingHints | None:
    """Routing hints of an OpenAI completions or chat request body; None for other routes or bodies
    that do not parse (the replica answers those; the router then only balances load).
    Never raises: whatever the body, the replica answers it as the server would.
    `salt_extra` joins the request's cache_salt (the API key under per-key cache isolation); so does the
    request's `model`, since each model a replica serves keeps its own prefix cache."""
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return None
    try:
        request = json.loads(body)
        prompt = _prompt(request, chat=path.endswith("chat/completions")) if isinstance(request, dict) else None
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
        return None
    if prompt is None:
        return None
    text, prompt_tokens = prompt
    salt = request.get("cache_salt")
    if salt_extra is not None:
        salt = json.dumps([salt, salt_extra])
    model = request.get("model")
    if isinstance(model, str) and model:  # with several models per replica, each has its own KV cache
        salt = json.dumps([salt, "model", model])
    max_tokens = request.get("max_completion_tokens") or request.get("max_tokens") or DEFAULT_MAX_TOKENS
    n = request.get("n") or 1
    if not isinstance(max_tokens, int) or not isinstance(n, int):
        return None
    load = max(n, 1) * (prompt_tokens + max(max_tokens, 0))
    return RoutingHints(prefix_keys(text, salt if isinstance(salt, str) else None), load, prompt_tokens)


def _prompt(request: dict[str, Any], chat: bool) -> tuple[str, int] | None:
    """The text the prefix keys cover, and the prompt's estimated number of tokens."""
    if chat:
        messages = request.get("messages")
        if not isinstance(messages, list):
            return None
        # A canonical rendering: a shared system prompt and history come first, as in the chat template.
        text = json.dumps(messages, sort_keys=True, separators=(",", ":"))
        return text, math.ceil(len(text) / CHARS_PER_TOKEN)
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first one places it
    if isinstance(prompt, list):  # token ids
        return ",".join(str(t) for t in prompt), len(prompt)
    return (prompt, math.ceil(len(prompt) / CHARS_PER_TOKEN)) if isinstance(prompt, str) else None


class PrefixAffinityPolicy:
    """Prefix affinity within a load slack, else least load. Not thread-safe: one event loop uses it."""

    def __init__(self, slack_tokens: int = 4096, max_keys: int = 100_000) -> None:
        if slack_tokens < 0:
            raise ValueError("slack_tokens must not be negative")
        self.slack_tokens = slack_tokens
        self.max_keys = max_keys
        # key -> replicas it was sent to, most recent last; the whole map is LRU over keys.
        self._holders: OrderedDict[str, list[str]] = OrderedDict()
        self._in_flight: dict[str, tuple[str, int]] = {}  # request id -> (replica, load tokens)
        self._local_load: dict[str, int] = {}

    def load(self, replica: str, reported: Mapping[str, int]) -> int:
        return max(self._local_load.get(replica, 0), reported.get(replica, 0))

    def choose(
        self, replicas: Sequence[str], hints: RoutingHints | None, reported: Mapping[str, int] | None = None
    ) -> Decision:
        """The replica for a request among `replicas` (non-empty). `reported`: each replica's own
        count of its queued and running tokens. Ties in load go to the first replica listed."""
        if not replicas:
            raise ValueError("no replicas to choose from")
        reported = reported or {}
        loads = {r: self.load(r, reported) for r in replicas}
        least = min(replicas, key=loads.__getitem__)
        keys = hints.prefix_keys if hints else ()
        for depth in range(len(keys), 0, -1):  # the longest shared prefix first
            holders = [r for r in self._holders.get(keys[depth - 1], ()) if r in loads]
            if holders:
                best = min(holders, key=loads.__getitem__)
                if loads[best] - loads[least] <= self.slack_tokens:
                    return Decision(best, True, depth)
        return Decision(least, False, 0)

    def on_routed(self, request_id: str, replica: str, hints: RoutingHints | None) -> None:
        """Count the request's load on `replica` and remember that it now holds the prefix."""
        tokens = hints.load_tokens if hints else 0
        self._in_flight[request_id] = (replica, tokens)
        self._local_load[replica] = self._local_load.get(replica, 0) + tokens
        for key in hints.prefix_keys if hints else ():
            holders = self._holders.pop(key, [])
            if replica in holders:
                holders.remove(replica)
            holders.append(replica)
            self._holders[key] = holders
        while len(self._holders) > self.max_keys:
            self._holders.popitem(last=False)

    def on_completed(self, request_id: str) -> None:
        replica, tokens = self._in_flight.pop(request_id, ("", 0))
        if replica:
            self._local_load[replica] -= tokens

    def forget_replica(self, replica: str) -> None:
        """A replica is gone: its cache went with it."""
        self._local_load.pop(replica, None)
        for key in list(self._holders):
            holders = self._holders[key]
            if replica in holders:
                holders.remove(replica)
                if not holders:
                    del self._holders[key]
