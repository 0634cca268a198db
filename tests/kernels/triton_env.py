"""Running Triton kernels on CPU tensors in Triton's interpreter, for the Triton kernel tests.

Triton reads TRITON_INTERPRET=1 when each @triton.jit function is defined (its own tl.sum, tl.max...
too) and again on lazy imports during a launch, so both must happen inside `interpreter_env()`; the
rest of the session never sees it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

ON_GPU = torch.cuda.is_available()


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """TRITON_INTERPRET=1 while a test file imports and runs kernels on CPU; nothing on a GPU."""
    if ON_GPU:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def skip_unless_interpretable() -> None:
    """Skip the calling test module when triton was imported earlier in this process without the
    interpreter (its own jit functions are then compiled ones, which cannot run on CPU). An import under
    the interpreter, by another Triton test file, is fine."""
    if ON_GPU or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET"):
        return
    language = sys.modules.get("triton.language")
    if language is not None and type(language.sum).__name__ == "InterpretedFunction":
        return
    pytest.skip(
        "triton was imported earlier in this process without TRITON_INTERPRET=1, so its kernels "
        "cannot run on CPU; run this file alone or with TRITON_INTERPRET=1",
        allow_module_level=True,
    )
