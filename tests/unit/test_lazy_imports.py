"""What a process imports before it does useful work: libraries that only some paths need (transformers for a
tokenizer, gguf for GGUF files, the HTTP server's) are imported where those paths begin, not at module level.
Each check runs in a fresh interpreter and reads sys.modules, so it does not depend on timing."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.tiny_models import TINY, make_tiny_tokenizer
from tokenmill.loader.hf_config import load_hf_config

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("transformers", "gguf", "fastapi", "uvicorn", "jinja2", "prometheus_client")


def _imported_after(code: str, stdin: bytes = b"", watched: tuple[str, ...] = HEAVY) -> list[str]:
    """The `watched` modules in sys.modules after a fresh interpreter runs `code`."""
    report = f"\nimport sys\nprint(' '.join(m for m in {watched!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code + report], input=stdin, cwd=REPO, capture_output=True, check=True, timeout=120
    )
    return done.stdout.decode().split()


def test_importing_the_offline_api_imports_no_tokenizer_gguf_or_server_library() -> None:
    assert _imported_after("import tokenmill\nfrom tokenmill import LLM, SamplingParams") == []


def test_the_engine_process_receives_its_model_config_without_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's engine process imports the core client, then unpickles the config it was spawned with.
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    AutoConfig.for_model("llama", **TINY).save_pretrained(tmp_path / "model")
    config = pickle.dumps(load_hf_config(tmp_path / "model"))
    code = "import pickle, sys\nimport tokenmill.engine.core_client\nconfig = pickle.loads(sys.stdin.buffer.read())"
    assert _imported_after(code, stdin=config) == []


def test_loading_a_tokenizer_imports_no_model_config_class(tmp_path: Path) -> None:
    # transformers 5's config classes import torch.distributed.tensor and torch._dynamo (about a second).
    AutoConfig.for_model("llama", **TINY).save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    code = f"from tokenmill.loader.hf import load_tokenizer\nload_tokenizer({str(tmp_path)!r})"
    config_modules = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor")
    assert _imported_after(code, watched=config_modules) == []


def test_starting_the_offline_api_imports_no_config_class_or_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # LLM() and a generate on a tiny model whose config is already resolved (as on every start after the first):
    # no transformers config class, and no torch._dynamo, which torch's Python meta kernels import on first use.
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    AutoConfig.for_model("llama", **TINY).save_pretrained(tmp_path / "model")
    make_tiny_tokenizer().save_pretrained(tmp_path / "model")
    load_hf_config(tmp_path / "model")
    code = (
        "from tokenmill import LLM, SamplingParams\n"
        f"llm = LLM({str(tmp_path / 'model')!r}, load_format='dummy', dtype='float32', num_kv_blocks=8)\n"
        "llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))"
    )
    watched = ("transformers.models.llama.configuration_llama", "torch.distributed.tensor", "torch._dynamo", "gguf")
    assert _imported_after(code, watched=watched) == []


def test_resolving_an_engine_config_imports_no_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `serve` imports the server and resolves the engine's config (the model's HF config, dtype, quantization)
    # before it spawns the engine process: none of that path imports torch (over a second) for itself. (A
    # checkpoint that names its dtype still does: the engine config holds a torch.dtype.)
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    AutoConfig.for_model("llama", **TINY).save_pretrained(tmp_path / "model")
    load_hf_config(tmp_path / "model")  # resolved once, as on every start after the first
    code = (
        "import tokenmill.cli, tokenmill.server.cli, tokenmill.server.launcher\n"
        "from tokenmill.config import EngineArgs\n"
        "from tokenmill.engine.engine_args import create_engine_config\n"
        f"create_engine_config(EngineArgs(model={str(tmp_path / 'model')!r}, load_format='dummy'))"
    )
    assert _imported_after(code, watched=("torch", "transformers")) == []
