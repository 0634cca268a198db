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

from tests.tiny_models import TINY
from tokenmill.loader.hf_config import load_hf_config

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("transformers", "gguf", "fastapi", "uvicorn", "jinja2", "prometheus_client")


def _imported_after(code: str, stdin: bytes = b"") -> list[str]:
    """The HEAVY libraries in sys.modules after a fresh interpreter runs `code`."""
    report = f"\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
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
