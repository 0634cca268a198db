"""LoRA in the scheduler: no step runs more distinct adapters than --max-loras (a request for another one
waits, then runs), and an adapter's prefix-cache blocks are its own."""

from __future__ import annotations

from tests.unit.test_scheduler import BS, FakeRunner, assert_no_block_leaked, make_request, steps
from tokenmill.config import SchedulerConfig
from tokenmill.lora_request import LoRARequest
from tokenmill.scheduling.kv_cache_manager import KVCacheManager
from tokenmill.scheduling.request import Request
from tokenmill.scheduling.scheduler import Scheduler

SQL, CHAT, MATH = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate(("sql", "chat", "math"), 1))


def _with(lora: LoRARequest | None, request: Request) -> Request:
    request.lora_request = lora
    return request


def test_no_step_runs_more_adapters_than_max_loras() -> None:
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(64, BS), max_loras=2)
    loras = [SQL, CHAT, MATH, SQL, None, MATH, CHAT, None]
    requests = [_with(lora, make_request(f"r{i}", max_tokens=3 + i % 3)) for i, lora in enumerate(loras)]
    for request in requests:
        scheduler.add_request(request)
    by_id = {r.req_id: r.lora_request for r in requests}
    first = None
    seen: set[str] = set()
    for out in steps(scheduler, FakeRunner()):
        adapters = {by_id[req_id] for req_id in out.num_scheduled_tokens} - {None}
        assert len(adapters) <= 2
        running = {r.lora_request for r in scheduler.running} - {None}
        assert len(running) <= 2
        first = first or set(out.num_scheduled_tokens)
        seen |= set(out.num_scheduled_tokens)
        for new in out.new_requests:
            assert new.lora_request == by_id[new.req_id]  # the runner learns each request's adapter
    assert first == {"r0", "r1", "r3", "r4", "r6", "r7"}  # math waited for a slot; the base never does
    assert seen == set(by_id)  # ... and then ran
    assert_no_block_leaked(scheduler)


def test_an_adapters_prefix_blocks_are_its_own() -> None:
    kv = KVCacheManager(64, BS)
    prompt = list(range(50, 62))

    def first_hash(lora: LoRARequest | None, salt: str | None = None) -> bytes:
        request = _with(lora, make_request(f"h{lora}{salt}", prompt=prompt))
        request.cache_salt = salt
        return kv.block_hashes(request)[0]

    hashes = [first_hash(None), first_hash(SQL), first_hash(CHAT), first_hash(SQL, "s"), first_hash(None, "s")]
    assert len(set(hashes)) == len(hashes)
    assert first_hash(SQL) == hashes[1]  # the same adapter shares its blocks
    renamed = LoRARequest("sql", 9, "/adapters/sql")  # a new id for the same adapter (a reload)
    assert first_hash(renamed) == hashes[1]
