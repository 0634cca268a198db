"""Shared fixtures: tiny random models of each supported family. And the tiers: every test is marked with
its folder's name (unit, kernels, e2e, server; registered in pyproject.toml), so `pytest -m unit` runs
the fast tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import FAMILIES, make_tiny_model

TESTS = Path(__file__).parent
TIERS = ("unit", "kernels", "e2e", "server")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else None
        if tier in TIERS:
            item.add_marker(tier)


@pytest.fixture(scope="session", params=list(FAMILIES))
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny model folder, once per family."""
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
