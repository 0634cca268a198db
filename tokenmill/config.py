"""Frozen, composed configuration. `EngineArgs` is what users pass; `engine.engine_args.create_engine_config`
turns it into an `EngineConfig` once the model's own config and the machine are known. A leaf: this module
imports only tokenmill.settings (a leaf too), so every layer may import it."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.settings import setting

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from tokenmill.loader.hf_config import HFConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
ASYNC_SCHEDULING = ("auto", "on", "off")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local HF folder, a .gguf file, or a preset name (with load_format="dummy")
    hf_config: HFConfig | PretrainedConfig  # HFConfig from the model source; transformers' own works too
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


KV_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "float32"  # what the cache stores (resolved from EngineArgs.kv_cache_dtype)
    num_kv_blocks: int | None = None  # explicit count; otherwise from the memory budget
    kv_cache_memory_gb: float = 2.0  # CPU budget for the KV cache
    # CUDA: the share of the device's memory the engine may use (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # The second KV tier (tokenmill/kv_tier): GiB of evicted prefix blocks kept (None: no tier), and where
    # the file tier lives on CPU (None: under the tokenmill cache folder).
    kv_offloading_size: float | None = None
    kv_offloading_path: str | None = None
    # Prefill/decode disaggregation over a file tier several engines share: "prefill" saves every finished
    # request's prompt blocks to it at once; "decode" also finds blocks other engines saved there.
    kv_role: str = "both"

    def __post_init__(self) -> None:
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"kv_offloading_size is in GiB and must be > 0, got {self.kv_offloading_size}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}.")
        if self.kv_role != "both" and self.kv_offloading_size is None:
            raise ValueError(
                f"kv_role {self.kv_role!r} passes KV blocks through the second tier's folder: give "
                "--kv-offloading-size (and the same --kv-offloading-path to the prefill and decode engines)."
            )
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
    # Schedule step N+1 while step N runs on the device (engine_core.py, _step_async); resolved from
    # --async-scheduling by engine_args.resolve_async_scheduling.
    async_scheduling: bool = False

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
class LoRAConfig:
    """LoRA adapters (tokenmill/lora): `max_loras` resident at once (the most distinct adapters in one
    step), ranks up to `max_lora_rank`, and `max_cpu_loras` read adapters kept in memory for reuse."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}).")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: each layer's weights split across `tensor_parallel_size` ranks; pipeline
    parallelism: the decoder layers split into `pipeline_parallel_size` stages (evenly, or
    `pp_layer_partition` layers each), each stage's layers split over its own tensor-parallel ranks. One
    process (or Ray actor) per rank, started by `distributed_executor_backend` ("mp": local processes,
    "ray")."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    pipeline_parallel_size: int = 1
    pp_layer_partition: tuple[int, ...] | None = None  # layers per stage, in order (None: as even as can be)

    def __post_init__(self) -> None:
        for what, n in (("tensor", self.tensor_parallel_size), ("pipeline", self.pipeline_parallel_size)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{what}_parallel_size must be an integer >= 1, got {n!r}.")
        partition = self.pp_layer_partition
        if partition is not None and (len(partition) != self.pipeline_parallel_size or min(partition) < 1):
            raise ValueError(
                f"pp_layer_partition {list(partition)} must give each of the {self.pipeline_parallel_size} "
                "pipeline stages at least one layer."
            )
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"unknown distributed_executor_backend {self.distributed_executor_backend!r}; "
                f"use one of {DISTRIBUTED_EXECUTOR_BACKENDS}."
            )

    @property
    def world_size(self) -> int:
        """Every rank: tensor_parallel_size per stage, pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_layers(self, hf_config: HFConfig | PretrainedConfig) -> list[tuple[int, int]]:
        """Each pipeline stage's decoder layers [start, end): pp_layer_partition, else as even as can be
        (the first stages taking one more: the last one also runs the final norm, the LM head and
        sampling)."""
        num_layers, pp = int(hf_config.num_hidden_layers), self.pipeline_parallel_size
        if self.pp_layer_partition is not None:
            sizes = list(self.pp_layer_partition)
            if sum(sizes) != num_layers:
                raise ValueError(f"pp_layer_partition {sizes} sums to {sum(sizes)} layers; the model has {num_layers}.")
        else:
            if pp > num_layers:
                raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers.")
            sizes = [num_layers // pp + (i < num_layers % pp) for i in range(pp)]
        starts = [sum(sizes[:i]) for i in range(pp)]
        return [(start, start + size) for start, size in zip(starts, sizes)]

    def check_model(self, hf_config: HFConfig | PretrainedConfig) -> None:
        """Raise a ValueError unless the model's heads split evenly over the ranks and its layers over
        the stages."""
        if self.pipeline_parallel_size > 1:
            self.stage_layers(hf_config)
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
    lora: LoRAConfig | None = None  # None: LoRA adapters off
    extra: dict[str, Any] = field(default_factory=dict)


def parse_speculative_config(value: str | dict[str, Any]) -> dict[str, Any]:
    """The parser of --speculative-config: a JSON object (or, from a config file, a mapping) with
    SpeculativeConfig's keys, checked here so that a bad value is a usage error before any model loads.
    Stays a dict (JSON-serialisable in reports)."""
    spec = value
    if isinstance(value, str):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(
                f"not valid JSON ({exc.msg} at column {exc.colno}); "
                """write e.g. '{"method": "ngram", "num_speculative_tokens": 4}'"""
            ) from exc
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(spec).__name__}")
    try:
        SpeculativeConfig.from_dict(spec)
    except (ValueError, TypeError) as exc:  # TypeError: a value of the wrong type reaching a comparison
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return spec


@dataclass
class EngineArgs:
    """Everything a user may set, each field also a flag of every command that builds an engine (names as
    in vLLM); `tokenmill.engine.engine_args.create_engine_config` resolves it against the model and the
    machine."""

    model: str | None = setting(
        None, group="model", metavar="MODEL", help="HF folder, .gguf file or preset (default: embedded SmolLM2)"
    )
    dtype: str = setting("auto", group="model", help="auto | bfloat16 | float32 | float16")
    max_model_len: int | None = setting(None, group="model", help="longest prompt + output (default: the model's)")
    max_num_seqs: int = setting(64, group="scheduler", help="most requests in one step")
    max_num_batched_tokens: int = setting(2048, group="scheduler", help="most tokens in one step")
    block_size: int = setting(16, group="cache", help="tokens per KV-cache block")
    kv_cache_dtype: str = setting(
        "auto",
        group="cache",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores; auto: bf16 on a CPU running bf16 or int8 weights, "
        "else the model's dtype; int8 (CPU with AVX-512 BF16): per-token scales, half of bf16",
    )
    num_kv_blocks: int | None = setting(None, group="cache", help="KV blocks (default: from the memory budget)")
    kv_cache_memory_gb: float = setting(2.0, group="cache", help="CPU: GiB for the KV cache")
    gpu_memory_utilization: float = setting(
        0.9, group="cache", help="CUDA: share of the GPU's memory for weights, activations and KV cache"
    )
    enable_prefix_caching: bool = setting(
        True, group="cache", aliases=("--prefix-caching",), help="reuse the KV blocks of prompts seen before"
    )
    kv_offloading_size: float | None = setting(
        None,
        group="cache",
        metavar="GiB",
        help="a second KV tier of this many GiB: prefix blocks evicted from the KV cache are kept there and "
        "loaded back on a hit (CPU: files that survive a restart; CUDA: host memory) (default: none)",
    )
    kv_offloading_path: str | None = setting(
        None,
        group="cache",
        metavar="DIR",
        help="CPU: the folder of the file tier (default: kv_tier/ under the tokenmill cache folder)",
    )
    kv_role: str = setting(
        "both",
        group="cache",
        choices=KV_ROLES,
        help="prefill/decode disaggregation through the file tier's folder (with --kv-offloading-size): "
        "prefill saves each finished request's prompt blocks there at once; decode finds blocks other "
        "engines saved (default: both, neither)",
    )
    load_format: str = setting("auto", group="model", choices=LOAD_FORMATS, help="how to read the weights")
    seed: int = setting(0, group="model", help="seed of random weights and of unseeded sampling")
    device: str = setting("cpu", group="model", help="cpu | cuda")
    attention_backend: str = setting("auto", group="model", help="auto | torch_ref | cpu | triton")
    scheduling_policy: str = setting("fcfs", group="scheduler", choices=SCHEDULING_POLICIES, help="request order")
    async_scheduling: str = setting(
        "auto",
        group="scheduler",
        choices=ASYNC_SCHEDULING,
        help="schedule the next step while the device runs this one, its sampled tokens kept on the device; "
        "auto: on CUDA (a CPU runs the model on the host's own cores: nothing to hide behind); off with "
        "speculative decoding, pipeline stages or the second KV tier",
    )
    quantization: str | None = setting(
        None,
        group="quantization",
        help="int8: per-channel int8 weights; int4: 4-bit weights in groups (see --quantization-group-size); "
        "quantized at load; gguf: a .gguf model's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K layers as the file stores them "
        "(default: none)",
    )
    quantization_group_size: int | None = setting(
        None, group="quantization", help="int4: in-features per scale, 32 or 128 (default 32)"
    )
    quantization_zero_point: bool = setting(
        False,
        group="quantization",
        help="int4: a float minimum per group as well as a scale (asymmetric; default symmetric)",
    )
    enforce_eager: bool = setting(
        False, group="model", help="run every layer from Python: no CUDA graphs, no fused CPU decode stack"
    )
    generation_config: str = setting(
        "auto",
        group="model",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for requests that leave them out: auto: the model's generation_config.json; "
        "vllm: ignore it (OpenAI's defaults); FOLDER: the generation_config.json in FOLDER",
    )
    speculative_config: dict[str, Any] | SpeculativeConfig | None = setting(
        None,
        group="speculative",
        metavar="JSON",
        parse=parse_speculative_config,
        help='speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(keys: method ngram|draft_model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
        "model, disable_by_batch_size); default: off",
    )
    tensor_parallel_size: int = setting(
        1,
        group="parallel",
        aliases=("-tp",),
        help="split every layer over N ranks, one process each (gloo on CPU: each rank gets its own cores)",
    )
    distributed_executor_backend: str = setting(
        "mp",
        group="parallel",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        help="what starts the tensor- and pipeline-parallel ranks: mp (local processes) or ray (a placement "
        "group; may span nodes)",
    )
    pipeline_parallel_size: int = setting(
        1,
        group="parallel",
        aliases=("-pp",),
        help="split the decoder layers into N stages, one process each per tensor-parallel rank (activations "
        "pass stage to stage; the last stage samples)",
    )
    pp_layer_partition: str | None = setting(
        None,
        group="parallel",
        metavar="N,N,...",
        help="decoder layers per pipeline stage, in order (default: as even as can be)",
    )
    enable_lora: bool = setting(False, group="lora", help="serve LoRA adapters (requests name one; see --lora-modules)")
    max_loras: int = setting(4, group="lora", help="adapters resident at once: the most distinct ones in one step")
    max_lora_rank: int = setting(16, group="lora", help="the highest adapter rank served")
    max_cpu_loras: int | None = setting(
        None, group="lora", help="adapters kept read in memory, beyond the resident ones (default: --max-loras)"
    )


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
