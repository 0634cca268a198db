"""Reasoning output (`--reasoning-parser`) and `chat_template_kwargs`. The parsers as units, on replies cut
at every position; then a server whose tiny model has a Qwen3-style template that opens `<think>` in the
prompt unless `enable_thinking` is false: its replies are reasoning (the prompt opened it), or an answer
(the kwarg reached the template), or, forced through a regex, both, split at the tags."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import CHATML, MODEL_NAME, RunningServer, make_chat_model, run_server
from tokenmill.server.cli import add_serve_parser, engine_and_server_config
from tokenmill.server.config import ServerConfig
from tokenmill.server.reasoning import REASONING_PARSERS, Reasoning, ReasoningStream
from tokenmill.server.tool_output import ReplyStream, whole_reply
from tokenmill.server.tool_parsers import TOOL_PARSERS
from tokenmill.server.tools import ToolPlan
from tokenmill.settings import parse_args

qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
OPENED, CLOSED = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def streamed(reasoning: Reasoning, pieces: list[str]) -> tuple[str, str, bool]:
    """(reasoning, content, whether no reasoning came after content) as `pieces` stream in."""
    stream = ReasoningStream(reasoning)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    first_content = next((i for i, p in enumerate(parts) if p.content), len(parts))
    in_order = not any(p.reasoning for p in parts[first_content + 1 :])
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts), in_order


CASES = [
    # (parser, prompt tail, constrained, reply, reasoning, content)
    (qwen3, "", False, "<think>Paris, then.</think>It is Paris.", "Paris, then.", "It is Paris."),
    (qwen3, "", False, "\n<think>cut by max_tok", "cut by max_tok", ""),
    (qwen3, "", False, "It is Paris. a </think> b", None, "It is Paris. a </think> b"),
    (qwen3, "", False, "<thin is not a tag", None, "<thin is not a tag"),
    (qwen3, OPENED, False, "Paris, then.</think>\n\nIt is Paris.", "Paris, then.", "\n\nIt is Paris."),
    (qwen3, OPENED, False, "no end yet </think", "no end yet </think", ""),
    (qwen3, CLOSED, False, "It is Paris.", None, "It is Paris."),
    (r1, "", False, "Hmm.</think>Paris.", "Hmm.", "Paris."),
    (r1, "", False, "<think>Hmm.</think>Paris.", "Hmm.", "Paris."),  # R1-0528 writes the tag again
    (r1, CLOSED, False, "all reasoning, no end", "all reasoning, no end", ""),
    (r1, "", True, '{"city": "Paris"}', None, '{"city": "Paris"}'),  # a constrained reply begins outside
    (r1, "", True, "<think>x</think>{}", "x", "{}"),
]


@pytest.mark.parametrize(("parser", "tail", "constrained", "reply", "reasoning", "content"), CASES)
def test_a_reply_splits_the_same_whole_and_cut_anywhere(
    parser: Any, tail: str, constrained: bool, reply: str, reasoning: str | None, content: str
) -> None:
    split = parser.for_reply(tail, constrained)
    assert split.split(reply) == (reasoning, content)
    for i in range(len(reply) + 1):
        assert streamed(split, [reply[:i], reply[i:]]) == (reasoning or "", content, True)
    assert streamed(split, list(reply)) == (reasoning or "", content, True)


def test_a_stream_holds_back_only_what_may_be_a_tag() -> None:
    stream = ReasoningStream(r1.for_reply("", False))
    assert stream.feed("Hmm </th") == ("Hmm ", "")
    assert stream.feed("ought") == ("</thought", "")
    assert stream.feed("</think>Paris") == ("", "Paris")


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls_are_read_from_the_content_part_only(size: int) -> None:
    plan = ToolPlan("auto", parser=TOOL_PARSERS["hermes"], reasoning=r1.for_reply("", False))
    for text, reasoning, calls in [
        (f"I will call it.</think>{CALL}", "I will call it.", 1),
        (f"Not yet: {CALL}</think>Paris.", f"Not yet: {CALL}", 0),
    ]:
        whole = whole_reply(plan, text, "stop")
        assert whole.reasoning == reasoning and len(whole.tool_calls or []) == calls
        stream = ReplyStream(plan)
        deltas = [stream.advance(text[i : i + size]) for i in range(0, len(text), size)] + [stream.close("stop")]
        assert "".join(d.reasoning for d in deltas) == reasoning
        assert "".join(d.content for d in deltas) == (whole.content or "")
        assert len([e for d in deltas for e in d.tool_calls if "id" in e]) == calls


# ---------------------------------------------------------------------- a server

# Qwen3's way (Qwen3.5, QwQ): the generation prompt opens <think>, or closes it at once without thinking.
THINKING_TEMPLATE = CHATML.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}",
)
MESSAGES: list[Any] = [{"role": "user", "content": "Where is the Eiffel tower?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
FORCED = "<think>Hmm, France.</think>Paris."  # a regex of plain characters
FORCE = {"structured_outputs": {"regex": FORCED.replace(".", r"\.")}, **NO_THINKING}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = make_chat_model(tmp_path_factory.mktemp("thinking"), THINKING_TEMPLATE)
    with run_server(Path(model), ServerConfig(reasoning_parser="qwen3")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def reply(client: openai.OpenAI, max_tokens: int = 8, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0, extra_body=extra
    )


def test_a_prompt_that_opens_think_makes_the_reply_reasoning(client: openai.OpenAI) -> None:
    out = reply(client)
    message = out.choices[0].message
    assert message.content is None and out.choices[0].finish_reason == "length"
    assert isinstance(getattr(message, "reasoning_content", None), str) and message.reasoning_content


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI) -> None:
    thinking, answering = reply(client), reply(client, **NO_THINKING)
    assert thinking.usage is not None and answering.usage is not None
    # "<think>\n" became "<think>\n\n</think>\n\n": a longer prompt, and no reasoning in the reply
    assert answering.usage.prompt_tokens > thinking.usage.prompt_tokens
    message = answering.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content


def test_a_forced_reply_splits_into_reasoning_and_content(client: openai.OpenAI) -> None:
    message = reply(client, max_tokens=60, **FORCE).choices[0].message
    assert (message.reasoning_content, message.content) == ("Hmm, France.", "Paris.")  # type: ignore[attr-defined]


def test_streamed_reasoning_comes_in_its_own_deltas_before_the_content(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=60, stream=True, extra_body=FORCE
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content" if d.content else None for d in deltas]
    kinds = [k for k in kinds if k is not None]
    assert kinds == sorted(kinds, reverse=True) and "reasoning" in kinds  # reasoning first
    assert all(not (getattr(d, "reasoning_content", None) and d.content) for d in deltas)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Hmm, France."
    assert "".join(d.content or "" for d in deltas) == "Paris."


def test_deepseek_r1_takes_a_reply_without_its_end_tag_as_reasoning(
    server: RunningServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        server.state, "config", dataclasses.replace(server.state.config, reasoning_parser="deepseek_r1")
    )
    message = reply(client, **NO_THINKING).choices[0].message  # even where the prompt closed <think>
    assert message.content is None and message.reasoning_content  # type: ignore[attr-defined]


def test_without_a_reasoning_parser_nothing_changes(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.state, "config", dataclasses.replace(server.state.config, reasoning_parser=None))
    body = {"messages": MESSAGES, "max_tokens": 60, **FORCE}
    with server.client() as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == FORCED


def test_the_servers_template_kwargs_apply_unless_the_request_gives_its_own(
    server: RunningServer, client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dataclasses.replace(server.state.config, chat_template_kwargs={"enable_thinking": False})
    monkeypatch.setattr(server.state, "config", config)
    default, asked = reply(client), reply(client, chat_template_kwargs={"enable_thinking": True})
    assert getattr(default.choices[0].message, "reasoning_content", None) is None and default.choices[0].message.content
    assert asked.choices[0].message.content is None and asked.choices[0].message.reasoning_content  # type: ignore[attr-defined]


def test_flags_and_config_file_set_the_servers_reasoning_settings(tmp_path: Path) -> None:
    root = argparse.ArgumentParser(prog="tokenmill")
    add_serve_parser(root.add_subparsers(dest="command"))
    flags = ["--reasoning-parser", "deepseek_r1", "--chat-template-kwargs", '{"enable_thinking": false}']
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("reasoning_parser: deepseek_r1\nchat_template_kwargs: {enable_thinking: false}\n")
    for argv in (flags, ["--config", str(yaml)]):
        _, config = engine_and_server_config(parse_args(root, ["serve", *argv]))
        assert (config.reasoning_parser, config.chat_template_kwargs) == ("deepseek_r1", {"enable_thinking": False})
    with pytest.raises(ValueError, match="'tools'"):
        ServerConfig(chat_template_kwargs={"tools": []})


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools", "eos_token"])
def test_reserved_template_variables_are_400s(client: openai.OpenAI, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        reply(client, chat_template_kwargs={name: True})
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "chat_template_kwargs"
    assert repr(name) in info.value.body["message"]
