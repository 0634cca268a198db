"""The Batch API's line format, shared by the server's runner and `tokenmill run-batch`: input lines
`{"custom_id", "method": "POST", "url", "body"}` checked as a whole before any runs, and output lines
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}` as OpenAI writes them."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_BATCH_LINES = 50_000  # OpenAI's bound on the requests of one batch


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_batch_lines(data: bytes, endpoint: str | None = None) -> list[BatchLine]:
    """Every line of a batch input file, or ValueError naming the first bad line (1-based). With
    `endpoint`, every line's url must be it (a batch runs one endpoint)."""
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError("the batch file is not UTF-8 text.") from exc
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = _parse_line(raw, number, endpoint)
        if line.custom_id in seen:
            raise ValueError(f"line {number}: custom_id {line.custom_id!r} is used twice; each must be unique.")
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > MAX_BATCH_LINES:
            raise ValueError(f"the batch file has more than {MAX_BATCH_LINES} requests; split it.")
    if not lines:
        raise ValueError("the batch file has no requests.")
    return lines


def _parse_line(raw: str, number: int, endpoint: str | None) -> BatchLine:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {number} is not valid JSON: {exc.msg}.") from exc
    if not isinstance(item, dict):
        raise ValueError(f"line {number} is not a JSON object.")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"line {number}: custom_id must be a non-empty string.")
    if method != "POST":
        raise ValueError(f'line {number}: method must be "POST".')
    if url not in BATCH_ENDPOINTS:
        raise ValueError(f"line {number}: url must be one of {', '.join(BATCH_ENDPOINTS)}.")
    if endpoint is not None and url != endpoint:
        raise ValueError(f"line {number}: url {url} differs from the batch's endpoint {endpoint}.")
    if not isinstance(body, dict):
        raise ValueError(f"line {number}: body must be a JSON object (the request).")
    return BatchLine(custom_id, url, body)


def output_line(custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """One request's result: its response (an error's body on failure, as the API answers it)."""
    request_id = "req_" + secrets.token_hex(12)
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": custom_id, "response": response, "error": None}


def done_custom_ids(*paths_text: str) -> set[str]:
    """The custom_ids of output lines already written (a restart skips them); a line cut short by a
    crash is left out, so that request runs again."""
    done: set[str] = set()
    for text in paths_text:
        for raw in text.splitlines():
            try:
                item = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if isinstance(item, dict) and isinstance(item.get("custom_id"), str):
                done.add(item["custom_id"])
    return done
