"""Property-based fuzzing from the server's own /openapi.json: valid and invalid bodies alike must
never get a 5xx, every response must match the schema, and the server must still serve afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance, status_code_conformance

from tests.server.conftest import RunningServer, run_server
from tokenmill.server.config import ServerConfig

# Per generation mode for each POST endpoint; the GET endpoints add a few more.
EXAMPLES = {"/v1/completions": 60, "/v1/chat/completions": 60}
MIN_CASES = 200


@pytest.fixture(scope="module")
def fuzzed(chat_model: Path) -> Iterator[RunningServer]:
    # Small caps keep every generated request short; the schema's own bounds are the server's.
    config = ServerConfig(max_tokens=8, max_n=2, max_prompts_per_request=4)
    with run_server(chat_model, config, max_model_len=128) as server:
        yield server


def test_generated_requests_never_get_a_5xx(fuzzed: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    cases = 0
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
                case.validate_response(
                    response, checks=[not_a_server_error, status_code_conformance, response_schema_conformance]
                )

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # no invalid request exists for a route without inputs
                assert mode == GenerationMode.NEGATIVE and path not in EXAMPLES
    assert cases >= MIN_CASES
    fuzzed.wait_idle()
    with fuzzed.client() as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200
