"""Frozen, composed configuration. `EngineArgs` is what users pass; `engine.engine_args.create_engine_config`
turns it into an `EngineConfig` once the model's own config and the machine are known. A leaf: this module
imports nothing of the package, so every layer may import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local HF folder, a .gguf file, or a preset name (with load_format="dummy")
    hf_config: PretrainedConfig
    dtype: str  # the arithmetic and KV cache dtype: "bfloat16" | "float32" | "float16"
    max_model_len: int
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None  # folder with the tokenizer files; None when the model has none
    quantization: str | None = None  # a method in tokenmill.quant (e.g. "int8"); None = full precision
    quantization_group_size: int | None = None  # int4: in-features per scale (None: 32)
    quantization_zero_point: bool = False  # int4: a minimum per group too
    # Set when the weights are rounded to a lower precision than `dtype` computes in: "bfloat16" asked
    # on a CPU without bf16 instructions runs bf16-rounded weights with float32 arithmetic.
    weight_dtype: str | None = None
    # Sampling a request gets for the fields it leaves out (SamplingParams field names: temperature, top_p,
    # top_k, min_p, repetition_penalty, max_tokens), read from generation_config.json as `generation_config`
    # says ("auto": the model's folder, "vllm": none, else a folder); explicit request values always win.
    generation_config: str = "auto"
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

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


SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
)
MAX_SPECULATIVE_TOKENS = 8  # the fused CPU decode stack takes queries of up to 1 + 8 tokens
# Above this many running requests speculation switches itself off: a step of that many rows is bound by
# arithmetic, not by reading the weights, so verifying k extra tokens per row costs nearly k times as
# much. Measured on the embedded model (BENCHMARKS.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's keys: a proposer guesses up to `num_speculative_tokens` tokens
    per step and the target model verifies them all in one forward pass. "ngram": prompt lookup over the
    request's own tokens (the longest n-gram of prompt_lookup_max down to prompt_lookup_min tokens that
    ends the sequence and occurred before; the tokens that followed it). "draft_model": a smaller model
    with the target's vocabulary (`model`: a folder, .gguf file or preset)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {SPECULATIVE_METHODS}.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError(
                'speculative method "draft_model" needs "model": the draft\'s folder, .gguf file or preset.'
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError('speculative method "ngram" takes no "model"; use method "draft_model" for a draft.')
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}.")

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict shape; an unknown key or a missing method / k is a ValueError."""
        unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {list(SPECULATIVE_KEYS)}.")
        for key in ("method", "num_speculative_tokens"):
            if key not in spec:
                raise ValueError(f"speculative_config needs {key!r}.")
        values = dict(spec)
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            if key in values and (not isinstance(values[key], int) or isinstance(values[key], bool)):
                raise ValueError(f"speculative_config {key!r} must be an integer, got {values[key]!r}.")
        # As vLLM: one lookup bound given alone sets the other.
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"], cls.prompt_lookup_max)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], cls.prompt_lookup_min)
        return cls(**values)


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: each layer's weights split across `tensor_parallel_size` ranks, one process (or
    Ray actor) per rank, started by `distributed_executor_backend` ("mp": local processes, "ray")."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}.")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"unknown distributed_executor_backend {self.distributed_executor_backend!r}; "
                f"use one of {DISTRIBUTED_EXECUTOR_BACKENDS}."
            )

    def check_model(self, hf_config: PretrainedConfig) -> None:
        """Raise a ValueError unless the model's heads split evenly over the ranks."""
        n = self.tensor_parallel_size
        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        if num_heads % n:
            raise ValueError(
                f"tensor_parallel_size {n} must divide the model's {num_heads} attention heads; "
                f"use one of {[d for d in range(1, num_heads + 1) if num_heads % d == 0]}."
            )
        if n <= num_kv_heads and num_kv_heads % n:
            raise ValueError(f"tensor_parallel_size {n} must divide the model's {num_kv_heads} KV heads.")
        if n > num_kv_heads and n % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size {n} exceeds the model's {num_kv_heads} KV heads, so each is copied "
                f"to several ranks: it must then be a multiple of {num_kv_heads}."
            )
        if int(hf_config.intermediate_size) % n:
            raise ValueError(
                f"tensor_parallel_size {n} must divide the MLP's intermediate size {hf_config.intermediate_size}."
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str = "cpu"
    attention_backend: str = "auto"  # "auto" | "torch_ref" | "cpu"
    enforce_eager: bool = False  # True: no CUDA graphs, no fused CPU decode stack
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineArgs:
    """Everything a user may set; `tokenmill.engine.engine_args.create_engine_config` resolves it against the
    model and the machine."""

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
    quantization: str | None = None  # "int8", "int4": quantized at load; "gguf": a .gguf file's own blocks
    quantization_group_size: int | None = None  # int4: in-features per scale, 32 or 128 (None: 32)
    quantization_zero_point: bool = False  # int4: a float minimum per group as well as a scale
    enforce_eager: bool = False  # every step layer by layer from Python: no CUDA graphs, no fused CPU decode
    # Where requests' sampling defaults come from (as vLLM's --generation-config): "auto" the model folder's
    # generation_config.json, "vllm" none (OpenAI's defaults), or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Speculative decoding in vLLM's dict shape (SpeculativeConfig's keys), or a SpeculativeConfig; None: off.
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None
    # Tensor parallelism: ranks that split every layer, and what starts them ("mp" processes or "ray" actors).
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: str, weight_dtype: str | None, quantization: str | None, device: str
) -> str:
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
