"""tokenmill: a high-throughput LLM inference engine you can read in an afternoon.

The public names load on first use: importing a subpackage (say `tokenmill.scheduling`, which is pure Python)
does not pull in the engine, torch and the model code."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
    from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "tokenmill.engine.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.sampling_params",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "Logprob": "tokenmill.outputs",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
