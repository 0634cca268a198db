"""Fixtures for server tests: a tiny random llama with a small real tokenizer and chat template, and
servers on loopback ports running in a background thread of the test process."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import TINY, make_tiny_model
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core_client import ThreadCoreClient
from tokenmill.engine.engine_core import EngineCore
from tokenmill.server.config import ServerConfig, ServerState
from tokenmill.server.launcher import GracefulServer, make_server
from tokenmill.server.pool.setup import create_state

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: tiny config's bos 1, eos 2
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML with tools as Qwen2.5's template writes them (Hermes format): the tools in a system message, an
# assistant's calls as <tool_call>{json}</tool_call>, tool results in <tool_response> blocks.
HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}{%- for tool in tools %}{{ '\n' + (tool | tojson) }}"
    '{%- endfor %}{{ \'\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant\n' + message.content }}"
    '{%- for call in message.tool_calls %}{{ \'<tool_call>\n{"name": "\' + call.function.name + '
    "'\", \"arguments\": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am a tiny model that says random things.",
    "def main():\n    return 42  # the answer\n",
] * 20
MODEL_NAME = "tiny-chat"


def make_chat_model(folder: Path, chat_template: str = CHATML) -> Path:
    """A tiny random llama (vocab 512) with a byte-level BPE tokenizer of the same size and ChatML (or
    `chat_template`)."""
    make_tiny_model(folder, "llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY["vocab_size"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return folder


def long_context_copy(model: Path, dest: Path, positions: int = 4096) -> Path:
    """A copy of `model` whose config allows `positions` positions, for generations that must run long."""
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def reseeded_copy(model: Path, dest: Path, seed: int) -> Path:
    """The chat model's tokenizer and template with other random weights: its greedy text differs."""
    shutil.copytree(model, dest)
    return make_tiny_model(dest, "llama", seed=seed)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="session")
def tool_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with a template that writes tools and tool calls (HERMES_TOOLS_TEMPLATE)."""
    return make_chat_model(tmp_path_factory.mktemp("tiny-tool-chat"), HERMES_TOOLS_TEMPLATE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_args(model: Path, **overrides: Any) -> EngineArgs:
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "max_model_len": 256,
        "num_kv_blocks": 128,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
    }
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


class RunningServer:
    def __init__(self, server: GracefulServer, thread: threading.Thread) -> None:
        self.server, self.thread = server, thread
        self.state: ServerState = server.state
        self.url = f"http://127.0.0.1:{server.config.port}"

    @property
    def engine(self) -> AsyncEngine:
        return self.state.engine

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until nothing is in flight and the engine has freed every block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.engine.snapshot  # what the engine last reported, wherever it runs
            if (
                not self.engine.streams
                and snap.num_running == snap.num_waiting == 0
                and snap.num_free_blocks == self.engine.num_blocks
            ):
                return
            time.sleep(0.02)
        raise AssertionError(f"still busy: {len(self.engine.streams)} streams, {self.free_blocks()} free blocks")

    def free_blocks(self) -> int:
        return self.engine.snapshot.num_free_blocks

    @property
    def core(self) -> EngineCore:
        """The engine core itself (servers whose engine runs on a thread of this process)."""
        assert isinstance(self.engine.client, ThreadCoreClient)
        return self.engine.client.core


@contextmanager
def run_server(
    model: Path, config: ServerConfig | None = None, engine_process: bool = False, **engine_overrides: Any
) -> Iterator[RunningServer]:
    """A real uvicorn server on a free loopback port, in a thread; stopped on exit. Its engine core runs
    on a thread (tests can reach into it) unless `engine_process`, as under `tokenmill serve`."""
    config = config or ServerConfig()
    config = ServerConfig(**{**config.__dict__, "port": free_port(), "served_model_name": MODEL_NAME})
    args = engine_args(model, **engine_overrides)
    engine = AsyncEngine(args, engine_process=engine_process)
    state = create_state(config, engine, args)  # with config.models: the model pool too
    server = make_server(state, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(server, thread)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def server(chat_model: Path) -> Iterator[RunningServer]:
    """As `tokenmill serve` runs: the engine core in a process of its own."""
    with run_server(chat_model, engine_process=True) as running:
        yield running
