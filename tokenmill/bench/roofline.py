"""This machine's decode roofline for a model (docs/benchmarking.md, "The limit"), measured in the same run as the
throughput it judges.

Each decode step reads every weight once (the matmul weights, the LM head included) plus the KV cache of
every running sequence, and spends 2 FLOPs per weight per token. With `batch` sequences decoding together:

    memory-bound   batch x bandwidth / (weight bytes + batch x context x KV bytes per token)   tok/s
    compute-bound  GEMM rate / (2 x matmul parameters)                                        tok/s
    ceiling        min(memory-bound, compute-bound)

Bandwidth is measured by reading a >= 1 GiB tensor; the GEMM rate by timing the model's own linear shapes
(M = batch rows) in the dtype used. Prompt tokens cost 2 FLOPs per decoder parameter too (they skip the LM
head), so the matmul FLOPs of all tokens per second against the peak rate (the same shapes at M = 512, a
prefill chunk) say how much of the machine's arithmetic a run used: `compute_fraction`. The decode ceiling
counts output tokens only; with prompts P and outputs O tokens long, no engine reaches more than about
O / (P + O) of it.

    shape = ModelShape.from_hf_config(json.load(open("config.json")))
    rates = measure_rates(shape, "float32", batch=64, threads=2)
    roof = decode_roofline(shape, rates, batch=64, avg_context=360)
    print(roof.ceiling_tok_s, 500 / roof.ceiling_tok_s)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

PEAK_ROWS = 512
# q4_0: 4-bit levels and a 16-bit scale per 32 weights; q4_1 a 16-bit minimum too (tokenmill's int4 the same)
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "q4_0": 18 / 32, "q4_1": 20 / 32}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=int(config["vocab_size"]),
        )

    def linear_shapes(self) -> list[tuple[int, int, int]]:
        """(out_features, in_features, how many) of every matmul of one forward pass, the LM head included."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = self.num_layers
        return [
            (q + 2 * kv, h, n),  # fused q/k/v projection
            (h, q, n),  # attention output
            (2 * self.intermediate_size, h, n),  # fused gate/up
            (h, self.intermediate_size, n),  # down
            (self.vocab_size, h, 1),  # LM head
        ]

    @property
    def matmul_params(self) -> int:
        return sum(out * inp * count for out, inp, count in self.linear_shapes())

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def gemm_flops(self, prompt_tokens: float, output_tokens: float) -> float:
        """The matmul FLOPs of a run: every token passes the decoder layers, but only sampled (output)
        tokens pass the LM head; a prompt token costs the decoder's 2 FLOPs per parameter."""
        decoder = self.matmul_params - self.lm_head_params
        return 2.0 * (decoder * (prompt_tokens + output_tokens) + self.lm_head_params * output_tokens)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * BYTES_PER_ELEMENT[dtype]


@dataclass(frozen=True)
class MachineRates:
    bandwidth_bytes_s: float  # reading a >= 1 GiB tensor
    gemm_flops: float  # the model's linear shapes at M = gemm_rows (the decode batch), in gemm_dtype
    gemm_dtype: str
    gemm_rows: int
    threads: int
    peak_gemm_flops: float = 0.0  # the same shapes at M = PEAK_ROWS (a prefill chunk): the best this CPU does


@dataclass(frozen=True)
class Roofline:
    batch: int
    avg_context: float
    weight_bytes: int
    kv_bytes_per_step: float
    memory_bound_tok_s: float
    compute_bound_tok_s: float  # at the decode batch's GEMM rate
    peak_compute_tok_s: float = 0.0  # at the peak GEMM rate: no engine processes (prompt + output) tokens faster

    @property
    def best_compute_tok_s(self) -> float:
        """At the best GEMM rate measured: at a decode batch's few rows the BLAS rate is itself bound
        by reading fp32 weights (which the memory bound counts already), and a kernel can beat it."""
        return max(self.compute_bound_tok_s, self.peak_compute_tok_s)

    @property
    def ceiling_tok_s(self) -> float:
        return min(self.memory_bound_tok_s, self.best_compute_tok_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_bound_tok_s < self.best_compute_tok_s else "compute"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ceiling_tok_s": self.ceiling_tok_s, "bound": self.bound}


def decode_roofline(
    shape: ModelShape, rates: MachineRates, batch: int, avg_context: float, weight_dtype: str, kv_dtype: str
) -> Roofline:
    """The decode ceiling (tok/s) of `batch` sequences whose KV caches hold `avg_context` tokens on average."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}.")
    weight_bytes = shape.matmul_params * BYTES_PER_ELEMENT[weight_dtype]
    kv_bytes = batch * avg_context * shape.kv_bytes_per_token(kv_dtype)
    return Roofline(
        batch=batch,
        avg_context=avg_context,
        weight_bytes=weight_bytes,
        kv_bytes_per_step=kv_bytes,
        memory_bound_tok_s=batch * rates.bandwidth_bytes_s / (weight_bytes + kv_bytes),
        compute_bound_tok_s=rates.gemm_flops / (2 * shape.matmul_params),
        peak_compute_tok_s=max(rates.peak_gemm_flops, rates.gemm_flops) / (2 * shape.matmul_params),
    )


def _sync(device: str) -> None:
    """Wait for the device's queued work: CUDA kernels run after their launch returns."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s reading a float32 tensor of `num_bytes` on `device` (best of `repeats` full passes)."""
    import torch

    if num_bytes < 1 << 30:
        raise ValueError("read at least 1 GiB, or caches inflate the bandwidth.")
    data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)  # [num_bytes / 4]
    data.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        data.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del data
    return num_bytes / best


def _gemm(dtype: str, rows: int, in_features: int, out_features: int, device: str) -> Callable[[], object]:
    """One linear layer's product at `rows` tokens in `dtype`; int8 is torch's int8 x int8 -> int32
    matmul (oneDNN, VNNI where the CPU has it)."""
    import torch

    if dtype == "int8":
        xi = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8, device=device)  # [rows, in_features]
        wi = torch.randint(-127, 128, (in_features, out_features), dtype=torch.int8, device=device)  # [in, out]
        return lambda: torch._int_mm(xi, wi)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    x = torch.randn(rows, in_features, dtype=torch_dtype, device=device)  # [rows, in_features]
    w = torch.randn(out_features, in_features, dtype=torch_dtype, device=device)  # [out_features, in_features]
    return lambda: torch.nn.functional.linear(x, w)


def measure_gemm(
    shape: ModelShape, dtype: str, rows: int, min_seconds: float = 0.2, blocks: int = 5, device: str = "cpu"
) -> float:
    """(FL)OP/s of the model's linear layers at `rows` tokens: sum of operations over sum of time, each
    shape weighted by how often a forward pass runs it, each timed as the best of `blocks` timing
    blocks (a ceiling should not include other processes' interruptions)."""
    import torch

    # A GPU queues launches faster than it runs them: wait for each group of launches, or the loop
    # queues seconds of work before the clock says stop.
    group = 10 if device.startswith("cuda") else 1
    flops = seconds = 0.0
    with torch.inference_mode():
        for out_features, in_features, count in shape.linear_shapes():
            gemm = _gemm(dtype, rows, in_features, out_features, device)
            gemm()  # warm-up
            best = float("inf")
            for _ in range(blocks):
                _sync(device)
                iters, start = 0, time.perf_counter()
                while time.perf_counter() - start < min_seconds / blocks or iters < 2:
                    for _ in range(group):
                        gemm()
                    iters += group
                    _sync(device)
                best = min(best, (time.perf_counter() - start) / iters)
            flops += 2 * rows * in_features * out_features * count
            seconds += best * count
    return flops / seconds


def measure_rates(shape: ModelShape, dtype: str, batch: int, threads: int, device: str = "cpu") -> MachineRates:
    """Bandwidth and GEMM rates on `device`, measured now with `threads` CPU threads. For 16-bit weights the
    GEMM rate is the better of computing in that dtype and in float32 (upconverting the weights): a CPU
    without native bf16 arithmetic (AVX2 only) is fastest through float32 FMAs, and an engine such as
    llama.cpp does exactly that, so torch's bf16 kernels alone would understate the ceiling."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = measure_bandwidth(device=device)
        # int8 weights: the fastest of an int8, a bf16 and a float32 GEMM (engines such as llama.cpp or
        # an AVX2 build compute int8 weights in 16- or 32-bit arithmetic).
        candidates = {
            "bfloat16": ["bfloat16", "float32"],
            "float16": ["float16", "float32"],
            "int8": ["int8", "bfloat16", "float32"],
            "q4_0": ["int8", "bfloat16", "float32"],  # 4-bit weights multiply as int8 (VNNI) or wider
            "q4_1": ["int8", "bfloat16", "float32"],
        }.get(dtype, [dtype])
        best = max(candidates, key=lambda d: measure_gemm(shape, d, batch, min_seconds=0.1, device=device))
        label = dtype if best == dtype else f"{dtype} as {best}"
        # The peak is the better dtype at PEAK_ROWS, chosen again: at one row a 16-bit GEMM can win by
        # reading half the bytes and still be far slower than float32 at a prefill's rows.
        peak = max(measure_gemm(shape, d, PEAK_ROWS, device=device) for d in candidates)
        gemm = measure_gemm(shape, best, batch, device=device)
        return MachineRates(bandwidth, gemm, label, batch, threads, peak_gemm_flops=peak)
    finally:
        torch.set_num_threads(previous)


def fraction_of(throughput_tok_s: float, ceiling_tok_s: float) -> float:
    return throughput_tok_s / ceiling_tok_s if ceiling_tok_s > 0 else 0.0


def compute_fraction(shape: ModelShape, rates: MachineRates, prompt_tok_s: float, output_tok_s: float) -> float:
    """The share of the peak GEMM rate a run's matmuls used: its matmul FLOP/s (prompt and output
    tokens, see ModelShape.gemm_flops) over the best rate measured."""
    peak = max(rates.peak_gemm_flops, rates.gemm_flops)
    return shape.gemm_flops(prompt_tok_s, output_tok_s) / peak if peak > 0 else 0.0


def format_roofline(rates: MachineRates, roof: Roofline) -> str:
    return (
        f"roofline: bandwidth {rates.bandwidth_bytes_s / 1e9:.1f} GB/s, GEMM {rates.gemm_flops / 1e9:.1f} GFLOP/s "
        f"({rates.gemm_dtype}, M={rates.gemm_rows}, {rates.threads} threads); batch {roof.batch}, "
        f"context {roof.avg_context:.0f}: memory-bound {roof.memory_bound_tok_s:.0f} tok/s, compute-bound "
        f"{roof.compute_bound_tok_s:.0f} tok/s at that GEMM rate, {roof.peak_compute_tok_s:.0f} tok/s at the peak "
        f"GEMM {rates.peak_gemm_flops / 1e9:.1f} GFLOP/s (M={PEAK_ROWS}) -> decode ceiling "
        f"{roof.ceiling_tok_s:.0f} tok/s ({roof.bound})"
    )
