"""/admin/... in fleet mode: every replica has its own model pool, so an admin call (load, unload, move
an alias, list) goes to each replica in turn, pinned to it through the request router; the answer holds
every replica's own answer. A replica that fails or does not answer is reported beside the others,
never dropped:

    200 {"replicas": [{"replica": ID, "status": 200, "body": {...}}, ...]}     every replica succeeded
    4xx {"error": {...}, "replicas": [...]}                                    every replica refused alike
    502 {"error": {"code": "partial_failure", ...}, "replicas": [...]}         anything else"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tokenmill.fleet.routing import PIN_REPLICA
from tokenmill.server.errors import error_body

# Loading a model on a replica takes seconds to minutes; a replica that left the fleet after the
# ingress listed it is never routed to, and this bounds the wait for it.
ADMIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ReplicaAnswer:
    replica: str
    status: int
    body: Any  # the replica's JSON answer (or its text when it is not JSON)

    def as_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "status": self.status, "body": self.body}


async def fan_out(
    targets: Sequence[tuple[DeploymentHandle[Any], str]],
    scope: dict[str, Any],
    body: bytes,
    timeout_s: float = ADMIN_TIMEOUT_S,
) -> JSONResponse:
    """Send one admin request to each of `targets` (a deployment's handle, one of its replica ids),
    one after another; answer with all their answers. One at a time: a load or unload
    rolls through the fleet while the other replicas serve, and Ray Serve tracks a call made while
    serving a request by that request's id, so two calls at once would be mixed up in routing."""
    if not targets:
        message = "no replica is running; retry when the fleet is up."
        return JSONResponse(error_body(503, message, "replica_unavailable") | {"replicas": []}, status_code=503)
    return combined([await _ask(handle, r, scope, body, timeout_s) for handle, r in targets])


def combined(answers: Sequence[ReplicaAnswer]) -> JSONResponse:
    """One answer for the client from every replica's answer (see the module's docstring)."""
    listed = [a.as_dict() for a in answers]
    if all(200 <= a.status < 300 for a in answers):
        return JSONResponse({"replicas": listed})
    if len({a.status for a in answers}) == 1 and isinstance(answers[0].body, dict) and "error" in answers[0].body:
        return JSONResponse({"error": answers[0].body["error"], "replicas": listed}, status_code=answers[0].status)
    failed = [a for a in answers if not 200 <= a.status < 300]
    message = f"{len(failed)} of {len(answers)} replicas failed: " + "; ".join(
        f"{a.replica}: {_message(a)}" for a in failed
    )
    return JSONResponse(error_body(502, message, "partial_failure") | {"replicas": listed}, status_code=502)


async def _ask(
    handle: DeploymentHandle[Any], replica: str, scope: dict[str, Any], body: bytes, timeout_s: float
) -> ReplicaAnswer:
    stream = cast(DeploymentResponseGenerator[Any], handle.remote(scope, body, routing={PIN_REPLICA: replica}))
    try:
        status, raw = await asyncio.wait_for(collect(stream), timeout_s)
    except asyncio.TimeoutError:
        stream.cancel()  # type: ignore[no-untyped-call]
        message = f"the replica did not answer within {timeout_s:g} s."
        return ReplicaAnswer(replica, 504, error_body(504, message, "replica_timeout"))
    except RayActorError as exc:
        message = f"the replica failed before answering ({type(exc).__name__})."
        return ReplicaAnswer(replica, 503, error_body(503, message, "replica_failed"))
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return ReplicaAnswer(replica, status, parsed)


async def collect(stream: DeploymentResponseGenerator[Any]) -> tuple[int, bytes]:
    """The status and whole body of a replica's answer (an admin call's, a prefill hop's: small JSON)."""
    status, chunks = 500, []
    async for batch in stream:
        for message in batch:
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
    return status, b"".join(chunks)


def _message(answer: ReplicaAnswer) -> str:
    error = answer.body.get("error") if isinstance(answer.body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return f"{answer.status} {error['message']}"
    return str(answer.status)
