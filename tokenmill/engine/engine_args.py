"""Engine arguments: the command-line flags every CLI shares, and their resolution against the model and
the machine into a frozen `EngineConfig`."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from tokenmill.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_kv_cache_dtype,
)
from tokenmill.loader.generation_config import describe_sampling_defaults, load_sampling_defaults
from tokenmill.loader.model_source import ModelSource, checkpoint_dtype, resolve_precision, resolve_source
from tokenmill.quant import QuantOptions, check_quantization

logger = logging.getLogger(__name__)


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource]:
    """The frozen config and the resolved model source (folder, tokenizer, eos ids)."""
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {args.load_format!r}; use one of {LOAD_FORMATS}.")
    check_quantization(args.quantization, QuantOptions(args.quantization_group_size, args.quantization_zero_point))
    source = resolve_source(args.model, args.load_format, args.quantization)
    hf_config = source.hf_config
    dtype, weight_dtype = resolve_precision(args.dtype, args.device, checkpoint_dtype(hf_config))
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
    # Sliding-window attention is not implemented: stay within the window, where it is exact.
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        model_max = min(model_max, int(window))
    max_model_len = min(args.max_model_len or model_max, model_max)
    model = ModelConfig(
        model=str(source.gguf_file or source.folder or args.model),  # gguf: the worker reads the file itself
        hf_config=hf_config,
        dtype=dtype,
        weight_dtype=weight_dtype,
        max_model_len=max_model_len,
        load_format=args.load_format,
        seed=args.seed,
        tokenizer=source.tokenizer,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantization_zero_point=args.quantization_zero_point,
        generation_config=args.generation_config,
        sampling_defaults=load_sampling_defaults(args.generation_config, source.folder),
    )
    cache = CacheConfig(
        block_size=args.block_size,
        kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, weight_dtype, args.quantization, args.device),
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=args.scheduling_policy,
    )
    speculative = resolve_speculative(args.speculative_config)
    config = EngineConfig(
        model,
        cache,
        scheduler,
        args.device,
        args.attention_backend,
        enforce_eager=args.enforce_eager,
        speculative=speculative,
        parallel=resolve_parallel(args, hf_config, speculative),
    )
    logger.info("%s", describe_sampling_defaults(model.generation_config, model.sampling_defaults))
    return config, source


def resolve_speculative(spec: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """EngineArgs.speculative_config as a checked SpeculativeConfig (None: speculation off); a ValueError
    names what is wrong."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if isinstance(spec, dict):
        return SpeculativeConfig.from_dict(spec)
    raise ValueError(
        "speculative_config must be a dict such as "
        f'{{"method": "ngram", "num_speculative_tokens": 4}}, a SpeculativeConfig or None; got {type(spec).__name__}.'
    )


def resolve_parallel(args: EngineArgs, hf_config: Any, speculative: SpeculativeConfig | None) -> ParallelConfig:
    """The checked ParallelConfig: the heads split evenly, and nothing asked that tensor parallelism lacks."""
    parallel = ParallelConfig(args.tensor_parallel_size, args.distributed_executor_backend)
    if parallel.tensor_parallel_size > 1:
        parallel.check_model(hf_config)
        if speculative is not None and speculative.method == "draft_model":
            raise ValueError(
                "speculative decoding with a draft model is not supported with tensor_parallel_size > 1; "
                'use {"method": "ngram"} or tensor_parallel_size 1.'
            )
        if args.device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL), not {args.device!r}.")
    return parallel


def describe_speculative(spec: SpeculativeConfig | None) -> str:
    """One short phrase for logs and reports, e.g. "ngram k=4 (lookup 2-5, off above 4 running)"."""
    if spec is None:
        return "off"
    how = (
        f"lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max}" if spec.method == "ngram" else f"draft {spec.model}"
    )
    return f"{spec.method} k={spec.num_speculative_tokens} ({how}, off above {spec.disable_by_batch_size} running)"


def parse_speculative_config(text: str) -> dict[str, Any]:
    """argparse type of --speculative-config: a JSON object with SpeculativeConfig's keys, checked here so
    that a bad value is a usage error before any model loads. Stays a dict (JSON-serialisable in reports)."""
    try:
        spec = json.loads(text)
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (names as in vLLM)."""
    d = EngineArgs()
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or preset (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default=d.dtype, help="auto | bfloat16 | float32 | float16")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores; auto: bf16 on a CPU running bf16 or int8 weights, "
        "else the model's dtype; int8 (CPU with AVX-512 BF16): per-token scales, half of bf16",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="CUDA: share of the GPU's memory for weights, activations and KV cache",
    )
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--load-format", default=d.load_format, help="auto | safetensors | gguf | dummy")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--attention-backend", default=d.attention_backend)
    parser.add_argument("--scheduling-policy", default=d.scheduling_policy, help="fcfs | priority")
    parser.add_argument(
        "--quantization",
        default=d.quantization,
        help="int8: per-channel int8 weights; int4: 4-bit weights in groups (see --quantization-group-size); "
        "quantized at load; gguf: a .gguf model's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K layers as the file stores them "
        "(default: none)",
    )
    parser.add_argument(
        "--quantization-group-size",
        type=int,
        default=d.quantization_group_size,
        help="int4: in-features per scale, 32 or 128 (default 32)",
    )
    parser.add_argument(
        "--quantization-zero-point",
        action="store_true",
        help="int4: a float minimum per group as well as a scale (asymmetric; default symmetric)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every layer from Python: no CUDA graphs, no fused CPU decode stack",
    )
    parser.add_argument(
        "--generation-config",
        default=d.generation_config,
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for requests that leave them out: auto: the model's "
        "generation_config.json; vllm: ignore it (OpenAI's defaults); FOLDER: the "
        "generation_config.json in FOLDER",
    )
    parser.add_argument(
        "--speculative-config",
        type=parse_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
        "(keys: method ngram|draft_model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
        "model, disable_by_batch_size); default: off",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split every layer over N ranks, one process each (gloo on CPU: each rank gets its own cores)",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        default=d.distributed_executor_backend,
        choices=["mp", "ray"],
        help="what starts the tensor-parallel ranks: mp (local processes) or ray (a placement group)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = [f for f in EngineArgs.__dataclass_fields__ if f != "model"]
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
