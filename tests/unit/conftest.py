"""The unit tier's promise: no compiler, no model, under a minute. A unit test that asks for our C++ kernels
(tokenmill.ops.build.load / load_ops, also under an availability check such as packed_gemm.available()
or cpu_ops(x)) or loads a model (an LLM or engine, a tiny model fixture) fails, saying where it belongs:
tests/kernels or tests/e2e. Code that takes its torch path without asking for the kernels (the sampler's
filters, the SDPA backend without its C++ part, ...) runs as it always does."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tokenmill.ops import build
from tokenmill.worker import model_runner

# tests/conftest.py's fixtures that build a tiny model (tests/tiny_models.py)
MODEL_FIXTURES = {"tiny_model", "llama_model"}


def _refuse_cpp(name: str) -> None:
    raise AssertionError(f"unit tests must not build C++: move this test to tests/kernels (it asked for {name!r})")


def _refuse_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("unit tests must not load a model: move this test to tests/e2e")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """The same refusal while a unit test module is imported (a module-level `packed_gemm.available()`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "load", _refuse_cpp)
        mp.setattr(build, "load_ops", _refuse_cpp)
        return (yield)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture is set up: the tiny models are session fixtures, built before the autouse ones."""
    if used := sorted(MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))):
        fixtures = ", ".join(used)
        raise AssertionError(f"unit tests must not load a model (fixture {fixtures}): move this test to tests/e2e")


@pytest.fixture(autouse=True)
def _no_cpp_kernels_and_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "load", _refuse_cpp)
    monkeypatch.setattr(build, "load_ops", _refuse_cpp)
    monkeypatch.setattr(model_runner, "load_model", _refuse_model)
