"""A finished Messages reply in Anthropic's terms, for the unstreamed body and the streamed events alike:
its content blocks (its reasoning as a thinking block, text, then one tool_use block per call),
stop_reason and stop_sequence, usage."""

from __future__ import annotations

import json
import uuid

from tokenmill.outputs import CompletionOutput
from tokenmill.server.anthropic_protocol import (
    MessageResponse,
    MessageUsage,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
)
from tokenmill.server.config import ServerState
from tokenmill.server.job import Job
from tokenmill.server.tool_output import Reply


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def message_response(
    state: ServerState, job: Job, message_id: str, reply: Reply, out: CompletionOutput
) -> MessageResponse:
    content: list[ThinkingOut | TextOut | ToolUseOut] = (
        [ThinkingOut(thinking=reply.reasoning)] if reply.reasoning else []
    )
    if reply.content:
        content.append(TextOut(text=reply.content))
    for call in reply.tool_calls or []:
        content.append(ToolUseOut(id=tool_use_id(), name=call.function.name, input=json.loads(call.function.arguments)))
    reason, sequence = stop_reason(reply.finish_reason, out.stop_reason)
    return MessageResponse(
        id=message_id,
        model=state.model_name,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=usage(job),
    )


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, matched: int | str | None) -> tuple[StopReason, str | None]:
    """Anthropic's stop_reason, and the stop sequence that ended the reply (the engine's stop_reason is
    the stop string that matched, or a stop token's id)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(job: Job) -> MessageUsage:
    """Prompt tokens found in the prefix cache count as cache reads, the rest as input (Anthropic's split)."""
    cached = job.num_cached_tokens
    return MessageUsage(
        input_tokens=job.num_prompt_tokens - cached,
        output_tokens=job.num_generated_tokens,
        cache_read_input_tokens=cached,
    )
