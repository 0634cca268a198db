"""Shared fixtures: tiny random models of each supported family."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import FAMILIES, make_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: loads a real model or takes seconds (deselect: -m 'not slow')")


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny model folder, once per family."""
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
