"""Frozen, composed configuration. `EngineArgs` is what users pass; `resolve()` turns it into an
`EngineConfig` once the model's own config and the machine are known."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local HF folder, a .gguf file, or a preset name (with load_format="dummy")
    hf_config: Any  # transformers.PretrainedConfig
    dtype: str  # the arithmetic and KV cache dtype: "bfloat16" | "float32" | "float16"
    max_model_len: int
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None  # folder with the tokenizer files; None when the model has none
    quantization: str | None = None  # a method in tokenmill.quant (e.g. "int8"); None = full precision
    # Set when the weights are rounded to a lower precision than `dtype` computes in: "bfloat16" asked
    # on a CPU without bf16 instructions runs bf16-rounded weights with float32 arithmetic.
    weight_dtype: str | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "float32"  # what the cache stores (resolved from EngineArgs.kv_cache_dtype)
    num_kv_blocks: int | None = None  # explicit count; otherwise from the memory budget
    kv_cache_memory_gb: float = 2.0  # CPU budget for the KV cache
    # CUDA: the share of the device's memory the engine may use (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization is a share of the device's memory in (0, 1], got "
                f"{self.gpu_memory_utilization}."
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; use one of {SCHEDULING_POLICIES}.")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto" | "torch_ref" | "cpu"
    enforce_eager: bool = False  # True: no CUDA graphs, no fused CPU decode stack
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineArgs:
    """Everything a user may set; `create_engine_config` resolves it against the model and machine."""

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # "auto": 16-bit on a CPU running bf16-rounded or int8 weights in float32 (decode attention reads
    # the whole cache every step: half the bytes), else the model's dtype
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    device: str = "cpu"
    attention_backend: str = "auto"
    scheduling_policy: str = "fcfs"
    quantization: str | None = None  # "int8": per-channel int8 weights, quantized at load
    enforce_eager: bool = False  # every step layer by layer from Python: no CUDA graphs, no fused CPU decode

    def create_engine_config(self) -> tuple[EngineConfig, Any]:
        """Returns the frozen config and the resolved model source (folder, tokenizer, eos ids)."""
        from tokenmill.loader.model_loader import resolve_precision, resolve_source

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; use one of {LOAD_FORMATS}.")
        from tokenmill.quant import check_quantization

        check_quantization(self.quantization)
        dtype, weight_dtype = resolve_precision(self.dtype, self.device)
        source = resolve_source(self.model, self.load_format)
        hf_config = source.hf_config
        model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
        # Sliding-window attention is not implemented: stay within the window, where it is exact.
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            model_max = min(model_max, int(window))
        max_model_len = min(self.max_model_len or model_max, model_max)
        model = ModelConfig(
            model=str(source.folder or self.model),
            hf_config=hf_config,
            dtype=dtype,
            weight_dtype=weight_dtype,
            max_model_len=max_model_len,
            load_format=self.load_format,
            seed=self.seed,
            tokenizer=source.tokenizer,
            quantization=self.quantization,
        )
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, weight_dtype, self.quantization,
                                                  self.device),
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
        )
        config = EngineConfig(
            model, cache, scheduler, self.device, self.attention_backend, enforce_eager=self.enforce_eager
        )
        return config, source


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str, weight_dtype: str | None, quantization: str | None,
                           device: str) -> str:
    """The KV cache's dtype. Only the CPU attention converts between the cache and the arithmetic dtype,
    and its C++ kernel reads float32 or bf16; its AVX-512 BF16 kernel also reads int8 (per token and
    head scales: attention/pair_layout.py), whose support the model runner checks once it knows the shapes."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use one of {KV_CACHE_DTYPES}.")
    if kv_cache_dtype == "auto":
        narrow_weights = weight_dtype == "bfloat16" or quantization is not None
        return "bfloat16" if device == "cpu" and dtype == "float32" and narrow_weights else dtype
    if kv_cache_dtype == "int8" and device != "cpu":
        raise ValueError("kv_cache_dtype 'int8' is read only by the CPU attention kernel; use 'auto' on this device.")
    if kv_cache_dtype != dtype and (device != "cpu" or kv_cache_dtype not in ("float32", "bfloat16", "int8")):
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} differs from the model's dtype {dtype!r}: only the CPU backend "
            "converts, to and from float32 or bfloat16; use 'auto'."
        )
    return kv_cache_dtype
