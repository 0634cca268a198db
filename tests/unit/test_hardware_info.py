"""`tokenmill info` (tokenmill/bench/hardware_info.py) and `--cost-per-hour` on `bench throughput` and
`bench serve` (tokenmill/bench/cli.py). Nothing here builds a kernel or runs a benchmark."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from tokenmill.bench import hardware_info
from tokenmill.bench.cli import add_bench_parser
from tokenmill.bench.report import cost_per_million_tokens, cost_report
from tokenmill.cli import main
from tokenmill.loader import model_source
from tokenmill.loader.model_source import resolve_dtype
from tokenmill.ops import build, kernel_cache

KEYS = {
    "cpu_model",
    "logical_cores",
    "cpus_available",
    "torch_threads",
    "isa",
    "cpu_isa_setting",
    "kernel_paths",
    "memory_total_gib",
    "memory_bandwidth_gb_s",
    "gpu",
    "kernels",
}


def test_info_has_every_key_and_at_least_one_core() -> None:
    info = hardware_info.gather().to_dict()
    assert set(info) == KEYS
    assert info["logical_cores"] >= 1 and info["cpus_available"] >= 1 and info["torch_threads"] >= 1
    assert set(info["isa"]) == {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx", "amx_tile"}
    assert info["memory_bandwidth_gb_s"] is None  # only measured with --bandwidth


def test_isa_flags_agree_with_the_kernel_build() -> None:
    isa = hardware_info.isa_flags()
    assert (isa["avx2"] and isa["fma"]) == build.cpu_has_avx2()
    # cpu_has_avx512_bf16 is also False under TOKENMILL_CPU_ISA=avx2, whatever the flags say.
    assert hardware_info.kernel_paths(isa).build.startswith("avx512") == build.cpu_has_avx512_bf16()
    assert hardware_info.kernel_paths(isa).build.endswith("+amx") == (
        build.cpu_has_avx512_bf16() and build.cpu_has_amx()
    )
    assert hardware_info.gather().cpu_isa_setting == build.cpu_isa()


def test_auto_dtype_is_what_the_loader_picks_here_for_a_bf16_checkpoint() -> None:
    assert hardware_info.kernel_paths(hardware_info.isa_flags()).auto_dtype == resolve_dtype("auto", "cpu", "bfloat16")


def _pretend(monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, avx2: bool, amx: bool = False) -> dict[str, bool]:
    monkeypatch.setattr(build, "cpu_has_avx512_bf16", lambda: avx512_bf16)
    monkeypatch.setattr(build, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(build, "cpu_has_avx2", lambda: avx2)
    monkeypatch.setattr(model_source, "cpu_has_avx512_bf16", lambda: avx512_bf16)  # what resolve_dtype asks
    return {name: avx512_bf16 or (avx2 and name in ("avx2", "fma")) for name in hardware_info.ISA_FLAGS}


def test_an_avx512_bf16_cpu_is_described_with_its_dot_product_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = hardware_info.kernel_paths(_pretend(monkeypatch, avx512_bf16=True, avx2=True))
    assert paths.build == "avx512"
    assert paths.auto_dtype == "bfloat16"
    assert "AVX-512 BF16 dot products" in paths.bf16_weights
    assert "sgemm" in paths.float32_weights  # float32 panels are the AVX2 build's
    assert "VNNI" in paths.int8_weights
    assert "AVX-512 paged attention" in paths.attention
    assert paths.int8_kv_cache == "yes"


def test_an_amx_cpu_runs_bf16_layers_on_tiles_and_the_rest_as_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = hardware_info.kernel_paths(_pretend(monkeypatch, avx512_bf16=True, avx2=True, amx=True))
    assert paths.build == "avx512+amx"
    assert "AMX-BF16 tiles" in paths.bf16_weights and "every row count" in paths.bf16_weights
    assert "AMX-INT8" in paths.int8_weights and "the same bits" in paths.int8_weights
    assert "AMX tiles" in paths.attention


def test_an_avx2_cpu_is_described_with_its_widening_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = hardware_info.kernel_paths(_pretend(monkeypatch, avx512_bf16=False, avx2=True))
    assert paths.build == "avx2"
    assert paths.auto_dtype == "bfloat16"  # bf16 weights widened in registers
    assert paths.bf16_weights == "widened to float32 in the GEMM (AVX2 FMA)"
    assert paths.float32_weights == "AVX2 FMA tiles on float32 panels"
    assert "AVX2 int16" in paths.int8_weights
    assert "portable C++ paged decode" in paths.attention
    assert paths.int8_kv_cache.startswith("no")


def test_avx512_flags_without_the_avx512_build_take_the_avx2_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    # TOKENMILL_CPU_ISA=avx2 on an AVX-512 machine: the flags are there, the build does not use them.
    isa = dict.fromkeys(hardware_info.ISA_FLAGS, True)
    _pretend(monkeypatch, avx512_bf16=False, avx2=True)
    assert hardware_info.kernel_paths(isa).build == "avx2"


def test_info_json_parses_and_reports_no_gpu_as_null(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main(["info", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert set(info) == KEYS
    assert info["gpu"] is None


def test_info_text_says_none_for_no_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main(["info"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split() == ["gpu", "none"]
    assert any(line.split()[:1] == ["attention"] for line in lines)


def test_bandwidth_is_a_positive_rate() -> None:
    assert hardware_info.measure_bandwidth_gb_s(nbytes=4 * 2**20, repeats=2) > 0


# ---------------------------------------------------------------------- --cost-per-hour
def test_cost_per_million_tokens_by_hand() -> None:
    # $3.60/hour at 1000 tok/s: 3.6M tokens cost $3.60, so 1M cost $1.00.
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    # $2.50/hour at 250 tok/s: 2.5 / (3600 * 250) * 1e6 = 2.777...
    assert cost_per_million_tokens(2.5, 250.0) == pytest.approx(2.5 / 900_000 * 1e6)


def test_cost_is_none_when_nothing_was_generated() -> None:
    assert cost_per_million_tokens(2.5, 0.0) is None


def test_cost_report_prices_output_and_total_tokens() -> None:
    assert cost_report(3.6, output_tok_s=1000.0, total_tok_s=4000.0) == pytest.approx(
        {"cost_per_hour": 3.6, "cost_per_million_output_tokens": 1.0, "cost_per_million_total_tokens": 0.25}
    )


def _bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("command", ["throughput", "serve"])
def test_cost_per_hour_is_parsed_as_dollars(command: str) -> None:
    args = _bench_parser().parse_args(["bench", command, "--cost-per-hour", "2.5"])
    assert args.cost_per_hour == 2.5


@pytest.mark.parametrize("command", ["throughput", "serve"])
def test_cost_per_hour_defaults_to_none(command: str) -> None:
    assert _bench_parser().parse_args(["bench", command]).cost_per_hour is None


@pytest.mark.parametrize("command", ["throughput", "serve"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "free"])
def test_cost_per_hour_must_be_a_positive_number(command: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _bench_parser().parse_args(["bench", command, f"--cost-per-hour={value}"])
    assert exc.value.code == 2
    assert "--cost-per-hour" in capsys.readouterr().err


def test_info_says_which_kernels_are_built_without_building_any(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path))
    lib = kernel_cache.library(build.kernel_folder("native"), build.extension_name("cpu_ops", "native"))
    lib.parent.mkdir(parents=True)
    lib.touch()  # as a finished build leaves it
    main(["info", "--json"])
    kernels = json.loads(capsys.readouterr().out)["kernels"]
    assert kernels["native"]["folder"] == str(build.kernel_folder("native"))
    assert kernels["native"]["built"] == {name: name == "cpu_ops" for name in build.SOURCES}
    assert set(kernels) == ({"native", "avx2"} if build.cpu_has_avx2() else {"native"})
    assert not any(kernels.get("avx2", {"built": {}})["built"].values())
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted([lib.parent.parent.name, lib.parent.name, lib.name])
    main(["info"])
    assert "not built: paged_decode, decode_stack" in capsys.readouterr().out
