"""Property-based fuzzing from the server's own /openapi.json: valid and invalid bodies alike must
never get a 5xx, every response must match the schema, and the server must still serve afterwards."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.checks import response_schema_conformance, status_code_conformance

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import PoolConfig, ServerConfig


def fuzz_scale() -> int:
    """TOKENMILL_FUZZ_SCALE multiplies the examples and the cases required: 1 in CI, 5 (>= 1,000 cases) for the
    slow run of bench/scripts/fuzz_api.sh."""
    text = os.environ.get("TOKENMILL_FUZZ_SCALE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"TOKENMILL_FUZZ_SCALE must be a whole number >= 1, got {text!r}.")
    return int(text)


SCALE = fuzz_scale()
# Examples per generation mode: the two generation routes most, every other route with a body some, the rest a few.
EXAMPLES = {"/v1/completions": 60 * SCALE, "/v1/chat/completions": 60 * SCALE}
BODY_EXAMPLES, OTHER_EXAMPLES = 10 * SCALE, 5 * SCALE
MIN_CASES = 200 * SCALE
ADMIN_KEY = "fuzz-admin-key"  # sent on /admin/ routes, so their bodies are checked rather than refused at the door
OUTPUT_ENV = "TOKENMILL_FUZZ_OUTPUT"  # where bench/scripts/fuzz_api.sh keeps the result (JSON)


@pytest.fixture(scope="module")
def fuzzed(chat_model: Path) -> Iterator[RunningServer]:
    # Small caps keep every generated request short; the schema's own bounds are the server's.
    # A second model (loaded only if a request names it) makes a pool, so the admin API is served and fuzzed too.
    pool = PoolConfig(extra_models=(("extra", str(chat_model)),), admin_key=ADMIN_KEY)
    config = ServerConfig(max_tokens=8, max_n=2, max_prompts_per_request=4, models=pool)
    with run_server(chat_model, config, max_model_len=128) as server:
        yield server


def test_generated_requests_never_get_a_5xx(fuzzed: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    cases = 0
    server_errors: list[str] = []  # every 5xx, not only the first: the count is the fuzz's result
    statuses: dict[str, Counter[int]] = {}  # by "METHOD path": how many cases got each status
    for result in schema.get_all_operations():
        operation = result.ok()
        path = operation.path
        statuses[f"{operation.method.upper()} {path}"] = Counter()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            examples = EXAMPLES.get(path, BODY_EXAMPLES if operation.body else OTHER_EXAMPLES)

            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case: schemathesis.Case) -> None:
                nonlocal cases
                cases += 1
                admin = {"Authorization": f"Bearer {ADMIN_KEY}"} if case.path.startswith("/admin/") else None
                response = case.call(base_url=fuzzed.url, timeout=30, headers=admin)
                statuses[f"{case.method.upper()} {case.path}"][response.status_code] += 1
                if response.status_code >= 500 and not _own_deadline(case, response.status_code):
                    server_errors.append(f"{response.status_code} {response.text[:200]}\n  {case.as_curl_command()}")
                    return
                case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # no invalid request exists for a route without inputs
                assert mode == GenerationMode.NEGATIVE
    print(f"\nfuzz: {cases} cases, {len(server_errors)} 5xx (TOKENMILL_FUZZ_SCALE={SCALE})")
    if os.environ.get(OUTPUT_ENV):
        kept = {"scale": SCALE, "cases": cases, "server_errors": len(server_errors), "examples": server_errors[:20]}
        kept["routes"] = {name: dict(sorted(counts.items())) for name, counts in statuses.items()}
        Path(os.environ[OUTPUT_ENV]).write_text(json.dumps(kept, indent=1) + "\n")
    assert not server_errors, f"{len(server_errors)} of {cases} cases got a 5xx:\n" + "\n".join(server_errors[:20])
    assert cases >= MIN_CASES
    fuzzed.wait_idle()
    with fuzzed.client() as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200


def _own_deadline(case: schemathesis.Case, status: int) -> bool:
    """A 504 for a request that set its own deadline (request_timeout, max_queue_time: any positive
    number, 5e-324 included) is the answer it asked for, not a server error."""
    body = case.body if isinstance(case.body, dict) else {}
    return status == 504 and any(body.get(k) is not None for k in ("request_timeout", "max_queue_time"))
