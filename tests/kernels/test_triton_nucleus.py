"""Top-k / top-p without a host sync (tokenmill/sample/triton_nucleus.py and distribution.py's device
path): the thresholds keep exactly what sorting the row keeps, the device path masks every row as the
host path does, and its PyTorch ops never read a value back to the host.

Without a GPU the kernel runs in Triton's interpreter: few rows, vocabularies of one tile. Random normal
float32 logits have no ties, so keeping ties (the device path) and picking among them (the sorted path)
cannot differ here."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.triton_env import ON_GPU, interpreter_env, skip_unless_interpretable
from tokenmill.sample import distribution
from tokenmill.sample.distribution import TOP_CANDIDATES, _apply_top_k_top_p, _apply_top_k_top_p_sorted

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed: `pip install -e '.[gpu]'` to run the Triton kernel tests", allow_module_level=True
    )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _import_kernel() -> ModuleType:
    skip_unless_interpretable()
    with interpreter_env():
        return importlib.import_module("tokenmill.sample.triton_nucleus")


@pytest.fixture(autouse=True, scope="module")
def _interpret_during_tests() -> Iterator[None]:
    with interpreter_env():
        yield


@pytest.fixture(scope="module")
def nucleus() -> ModuleType:
    return _import_kernel()


def _settings(vocab: int, ks: list[int], ps: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(ks, dtype=torch.int64, device=DEVICE).clamp(max=vocab),
        torch.tensor(ps, dtype=torch.float32, device=DEVICE),
    )


def _sorted_keeps(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    masked = logits.clone()
    _apply_top_k_top_p_sorted(masked, top_k, top_p)
    return torch.isfinite(masked)


def test_thresholds_keep_what_sorting_the_row_keeps(nucleus: ModuleType) -> None:
    vocab = 300
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, vocab, generator=gen) * 3).to(DEVICE)  # [8, vocab]
    # top-k alone, top-p alone (small and large), both, and one with neither (keeps everything).
    top_k, top_p = _settings(
        vocab, [5, 120, vocab, vocab, 40, 290, vocab, 1], [1.0, 1.0, 0.5, 0.95, 0.9, 0.3, 1.0, 0.7]
    )
    thresholds = nucleus.nucleus_thresholds(logits, top_k, top_p, torch.ones(8, dtype=torch.bool, device=DEVICE))
    kept = logits >= thresholds.unsqueeze(1)
    assert torch.equal(kept, _sorted_keeps(logits, top_k, top_p))
    assert kept.sum(dim=1).tolist()[:2] == [5, 120] and kept[6].all() and kept[7].sum() == 1


def test_banned_tokens_do_not_count_and_unflagged_rows_keep_everything(nucleus: ModuleType) -> None:
    vocab = 200
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, vocab, generator=gen) * 2).to(DEVICE)
    logits[:, ::3] = float("-inf")  # banned tokens (a grammar, min_tokens) before the filters
    top_k, top_p = _settings(vocab, [150, vocab, 10, 10], [1.0, 0.99, 0.8, 0.8])
    rows = torch.tensor([True, True, True, False], device=DEVICE)
    thresholds = nucleus.nucleus_thresholds(logits, top_k, top_p, rows)
    kept = logits >= thresholds.unsqueeze(1)
    expected = _sorted_keeps(logits, top_k, top_p)
    assert torch.equal(kept[:3] & torch.isfinite(logits[:3]), expected[:3])
    assert thresholds[3] == float("-inf")


def test_the_device_path_masks_every_row_as_the_host_path_does(nucleus: ModuleType) -> None:
    """Rows the candidates answer (peaked, or a small top-k) and rows past them (flat, a nucleus or top-k
    wider than the candidates) in one batch: the same logits survive, with the same values."""
    vocab = TOP_CANDIDATES + 200
    gen = torch.Generator().manual_seed(2)
    peaked = torch.randn(3, vocab, generator=gen) * 8
    flat = torch.randn(3, vocab, generator=gen) * 0.5
    logits = torch.cat([peaked, flat]).to(DEVICE)  # [6, vocab]
    top_k, top_p = _settings(
        vocab, [20, vocab, vocab, vocab, TOP_CANDIDATES + 50, vocab], [0.9, 0.9, 1.0, 0.95, 1.0, 1.0]
    )
    host, device = logits.clone(), logits.clone()
    _apply_top_k_top_p(host, top_k, top_p, sync_free=False)
    _apply_top_k_top_p(device, top_k, top_p, sync_free=True)
    assert torch.equal(host, device)
    assert torch.isfinite(device[3]).sum() > TOP_CANDIDATES  # a flat row's nucleus is past the candidates
    assert torch.equal(device[5], logits[5])  # no filter: untouched


class _Reads(TorchDispatchMode):
    """The ATen ops run, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_the_device_path_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `.item()`, `bool(tensor)` or boolean-mask indexing (each waits for the device): the kernel is a
    launch like any other, so it is stubbed here to watch PyTorch's ops alone."""
    vocab = TOP_CANDIDATES + 100
    logits = torch.randn(4, vocab, device=DEVICE)
    top_k, top_p = _settings(vocab, [10, vocab, vocab, vocab], [0.9, 0.95, 0.5, 1.0])
    stub = ModuleType("tokenmill.sample.triton_nucleus")
    stub.nucleus_thresholds = lambda x, k, p, rows: torch.full((x.shape[0],), float("-inf"), device=x.device)  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "tokenmill.sample.triton_nucleus", stub)
    with _Reads() as reads:
        distribution._apply_top_k_top_p(logits, top_k, top_p, sync_free=True)
    syncing = {"aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.item"}
    assert reads.names and syncing.isdisjoint(reads.names), reads.names
    host_reads: list[str] = []
    with _Reads() as reads:
        distribution._apply_top_k_top_p(logits.clone(), top_k, top_p, sync_free=False)
        host_reads = reads.names
    assert not syncing.isdisjoint(host_reads)  # the host path does read back: the check can fail
