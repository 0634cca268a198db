"""The official `openai` client against `tokenmill serve`: completions and chat, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_completion_returns_max_tokens_tokens_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_completion_accepts_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 3


def test_batched_prompts_get_one_choice_each_in_order(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=["Hello", "The capital"],
        max_tokens=2,
        n=2,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples of a prompt agree


def test_streamed_completion_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    kwargs = {
        "model": MODEL_NAME,
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=chat("Hi!"), max_completion_tokens=5)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage is not None and 1 <= out.usage.completion_tokens <= 5


def test_streamed_chat_equals_the_unstreamed_one(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "messages": chat("Tell me a story"), "max_tokens": 10, "temperature": 0.0}
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_n_2_streams_both_choices(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=chat("Hi"), n=2, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks[1:] if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    free = (
        client.completions.create(
            model=MODEL_NAME, prompt="Hello", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = free[4:6]
    assert len(stop) == 2
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=24, temperature=0.0, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == free[: free.index(stop)]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str | None:
        return (
            client.chat.completions.create(
                model=MODEL_NAME,
                messages=chat("Hi"),
                max_tokens=12,
                seed=seed,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in range(4)}) > 1


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=4, logprobs=2, seed=7, extra_body={"ignore_eos": True}
    ).choices[0]
    assert out.logprobs is not None
    assert len(out.logprobs.tokens or []) == 4 and "".join(out.logprobs.tokens or []) == out.text
    assert all(lp is not None and lp <= 0 for lp in out.logprobs.token_logprobs or [])
    # top 2 plus the sampled token; fewer when two tokens decode to the same text (e.g. partial UTF-8)
    assert all(1 <= len(top) <= 3 for top in out.logprobs.top_logprobs or [])
    assert max(len(top) for top in out.logprobs.top_logprobs or []) >= 2


def test_echo_returns_the_prompt_and_its_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hello world", max_tokens=2, echo=True, logprobs=1, extra_body={"ignore_eos": True}
    ).choices[0]
    assert out.text.startswith("Hello world")
    assert out.logprobs is not None and out.logprobs.token_logprobs is not None
    assert out.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=chat("Hi"),
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert out.logprobs is not None and out.logprobs.content is not None
    assert len(out.logprobs.content) == 3
    for entry in out.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found"


def test_bad_parameter_is_400_with_openai_error_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, temperature=-1.0)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error" and body["param"] == "temperature"


def test_constrained_output_and_a_named_tool_call_cross_the_engine_process(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=chat("Yes or no?"),
        max_tokens=10,
        seed=3,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert out.choices[0].message.content in ("yes", "no")
    parameters = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["n"],
        "additionalProperties": False,
    }
    tools: Any = [{"type": "function", "function": {"name": "pick", "parameters": parameters}}]
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=chat("Pick one"),
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "pick"}},
        max_tokens=20,
    ).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls is not None
    call = reply.message.tool_calls[0]
    assert call.function.name == "pick" and json.loads(call.function.arguments)["n"] in (1, 2, 3)


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_usage_reports_prompt_tokens_found_in_the_prefix_cache(client: openai.OpenAI, route: str, stream: bool) -> None:
    text = f"{route} {stream}: " + "a long shared prefix that fills several KV blocks " * 4

    def cached() -> int:
        common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 2}
        if stream:
            common |= {"stream": True, "stream_options": {"include_usage": True}}
        if route == "completions":
            out: Any = client.completions.create(prompt=text, **common)
        else:
            out = client.chat.completions.create(messages=chat(text), **common)  # type: ignore[arg-type]
        usage = [c.usage for c in out if c.usage is not None][-1] if stream else out.usage
        assert usage.prompt_tokens_details is not None
        return int(usage.prompt_tokens_details.cached_tokens)

    assert cached() == 0
    again = cached()
    assert again > 0 and again % 16 == 0  # whole KV blocks of 16 tokens
