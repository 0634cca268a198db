"""Property-based fuzzing from the server's own /openapi.json: valid and invalid bodies alike must
never get a 5xx, every response must match the schema, and the server must still serve afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.checks import response_schema_conformance, status_code_conformance

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import ServerConfig


def fuzz_scale() -> int:
    """TOKENMILL_FUZZ_SCALE multiplies the examples and the cases required: 1 in CI, 5 (>= 1,000 cases) for the
    slow run of bench/scripts/fuzz_api.sh."""
    text = os.environ.get("TOKENMILL_FUZZ_SCALE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"TOKENMILL_FUZZ_SCALE must be a whole number >= 1, got {text!r}.")
    return int(text)


SCALE = fuzz_scale()
# Per generation mode for each POST endpoint; the GET endpoints add a few more.
EXAMPLES = {"/v1/completions": 60 * SCALE, "/v1/chat/completions": 60 * SCALE}
MIN_CASES = 200 * SCALE


@pytest.fixture(scope="module")
def fuzzed(chat_model: Path) -> Iterator[RunningServer]:
    # Small caps keep every generated request short; the schema's own bounds are the server's.
    config = ServerConfig(max_tokens=8, max_n=2, max_prompts_per_request=4)
    with run_server(chat_model, config, max_model_len=128) as server:
        yield server


def test_generated_requests_never_get_a_5xx(fuzzed: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    cases = 0
    server_errors: list[str] = []  # every 5xx, not only the first: the count is the fuzz's result
    for result in schema.get_all_operations():
        operation = result.ok()
        path = operation.path
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            examples = EXAMPLES.get(path, 5)

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
                response = case.call(base_url=fuzzed.url, timeout=30)
                if response.status_code >= 500 and not _own_deadline(case, response.status_code):
                    server_errors.append(f"{response.status_code} {response.text[:200]}\n  {case.as_curl_command()}")
                    return
                case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # no invalid request exists for a route without inputs
                assert mode == GenerationMode.NEGATIVE and path not in EXAMPLES
    print(f"\nfuzz: {cases} cases, {len(server_errors)} 5xx (TOKENMILL_FUZZ_SCALE={SCALE})")
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
