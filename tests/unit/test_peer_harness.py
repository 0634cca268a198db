"""The one timing harness every `bench compare` driver runs through (peers/drivers/peer_protocol.py): what
it times, what it counts, and that it needs nothing but the standard library (drivers run in peers' venvs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenmill.bench.peers.drivers import peer_protocol
from tokenmill.bench.peers.drivers.peer_protocol import (
    WARMUP_PROMPT,
    LoadedEngine,
    PeerPrompt,
    PeerRequest,
    PeerResult,
    RunResult,
    in_static_batches,
    time_engine,
)

DRIVERS = Path(peer_protocol.__file__).parent


class FakeClock:
    """perf_counter for the harness: time moves only when the fake engine works."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(peer_protocol, "time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def request(*runs: list[PeerPrompt]) -> PeerRequest:
    return PeerRequest(engine="fake", model="/m", dtype="float32", threads=1, seed=0, runs=list(runs))


RUN_A = [PeerPrompt([1, 2, 3], 2, 0.0), PeerPrompt([4], 3, 0.0)]
RUN_B = [PeerPrompt([5, 6], 1, 0.0)]


def test_startup_warmup_and_each_run_are_timed_apart(clock: FakeClock) -> None:
    calls: list[str] = []

    def generate(prompts: list[PeerPrompt]) -> list[list[int]]:
        calls.append(f"generate {len(prompts)}")
        clock.now += 0.5 * len(prompts)  # half a second per prompt
        return [[7] * (p.output_len + 1) for p in prompts]  # one id past each output_len: not counted

    def load() -> LoadedEngine:
        calls.append("load")
        clock.now += 5.0

        def settings() -> dict[str, object]:
            calls.append("settings")
            return {"threads": 1}

        return LoadedEngine(version="1.2", generate=generate, settings=settings, notes=["a note"])

    result = time_engine(request(RUN_A, RUN_B), load)
    assert calls == ["load", "generate 1", "generate 2", "generate 1", "settings"]  # warm-up: one prompt
    assert (result.startup_s, result.warmup_s) == (5.0, 0.5)
    assert result.runs == [
        RunResult(num_requests=2, prompt_tokens=4, output_tokens=5, elapsed_s=1.0, generated_tokens=7),
        RunResult(num_requests=1, prompt_tokens=2, output_tokens=1, elapsed_s=0.5, generated_tokens=2),
    ]
    assert (result.engine, result.version, result.settings, result.notes) == ("fake", "1.2", {"threads": 1}, ["a note"])


def test_each_variant_is_its_own_run_and_the_warmup_uses_generate(clock: FakeClock) -> None:
    seen: list[tuple[str, int]] = []

    def named(name: str, seconds: float) -> peer_protocol.Generate:
        def generate(prompts: list[PeerPrompt]) -> list[list[int]]:
            seen.append((name, len(prompts)))
            clock.now += seconds
            return [[0] * p.output_len for p in prompts]

        return generate

    engine = LoadedEngine(
        version="v",
        generate=named("default", 9.0),
        variants=[("batch 1", named("b1", 2.0)), ("batch 8", named("b8", 1.0))],
        warmup_prompts=[WARMUP_PROMPT, WARMUP_PROMPT],
    )
    result = time_engine(request(RUN_A, RUN_B), lambda: engine)
    assert seen == [("default", 2), ("b1", 2), ("b8", 2), ("b1", 1), ("b8", 1)]
    assert result.warmup_s == 9.0
    assert [(r.variant, r.elapsed_s, r.output_tokens) for r in result.runs] == [
        ("batch 1", 2.0, 5),
        ("batch 8", 1.0, 5),
        ("batch 1", 2.0, 1),
        ("batch 8", 1.0, 1),
    ]


def test_static_batches_come_back_in_prompt_order() -> None:
    prompts = [PeerPrompt([i], output_len, 0.0) for i, output_len in enumerate([3, 1, 2, 1])]
    batches: list[list[int]] = []

    def generate_batch(batch: list[PeerPrompt]) -> list[list[int]]:
        batches.append([p.prompt_token_ids[0] for p in batch])
        return [[p.prompt_token_ids[0]] * p.output_len for p in batch]

    outputs = in_static_batches(generate_batch, 2)(prompts)
    assert outputs == [[0, 0, 0], [1], [2, 2], [3]]
    assert batches == [[1, 3], [2, 0]]  # shortest outputs first, at most 2 a batch


def test_a_driver_on_the_harness_runs_with_the_standard_library_alone(tmp_path: Path) -> None:
    # `python -S`: no site-packages, so neither tokenmill nor torch can be imported, as in a peer's venv.
    driver = tmp_path / "fake_driver.py"
    driver.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(DRIVERS)!r})\n"
        "from peer_protocol import LoadedEngine, serve, time_engine\n"
        "def generate(prompts):\n"
        "    return [[1] * p.output_len for p in prompts]\n"
        "def drive(request):\n"
        "    return time_engine(request, lambda: LoadedEngine(version='fake 1', generate=generate))\n"
        "sys.exit(serve(drive))\n"
    )
    request_path, result_path = tmp_path / "request.json", tmp_path / "result.json"
    request_path.write_text(request(RUN_A).to_json())
    proc = subprocess.run(
        [sys.executable, "-S", str(driver), str(request_path), str(result_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    result = PeerResult.from_json(result_path.read_text())
    assert result.error is None and result.version == "fake 1"
    assert [(r.num_requests, r.output_tokens) for r in result.runs] == [(2, 5)]
