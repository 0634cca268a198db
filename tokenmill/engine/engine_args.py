"""Engine arguments: the command-line flags every CLI shares, and their resolution against the model and
the machine into a frozen `EngineConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from tokenmill.config import (
    ASYNC_SCHEDULING,
    LOAD_FORMATS,
    CacheConfig,
    EngineArgs,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    resolve_kv_cache_dtype,
)
from tokenmill.loader.generation_config import describe_sampling_defaults, load_sampling_defaults
from tokenmill.loader.model_source import ModelSource, checkpoint_dtype, resolve_precision, resolve_source
from tokenmill.settings import add_config_flag, add_flags, add_help_group_flag, from_namespace

logger = logging.getLogger(__name__)

# Model types whose models implement their sliding window (models/gemma.py, models/phi3.py).
WINDOWED_MODEL_TYPES = frozenset({"gemma2", "gemma3_text", "phi3"})


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource]:
    """The frozen config and the resolved model source (folder, tokenizer, eos ids)."""
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {args.load_format!r}; use one of {LOAD_FORMATS}.")
    if args.quantization is not None or args.quantization_group_size is not None or args.quantization_zero_point:
        from tokenmill.quant import QuantOptions, check_quantization  # torch: only where quantization is asked

        check_quantization(args.quantization, QuantOptions(args.quantization_group_size, args.quantization_zero_point))
    source = resolve_source(args.model, args.load_format, args.quantization)
    hf_config = source.hf_config
    dtype, weight_dtype = resolve_precision(args.dtype, args.device, checkpoint_dtype(hf_config))
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 4096)
    # Families without sliding-window attention (all but Gemma's) stay within the window, where they are exact.
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and hf_config.model_type not in WINDOWED_MODEL_TYPES:
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
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_path=args.kv_offloading_path,
        kv_role=args.kv_role,
    )
    speculative = resolve_speculative(args.speculative_config)
    parallel = resolve_parallel(args, hf_config, speculative)
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=args.scheduling_policy,
        async_scheduling=resolve_async_scheduling(args, speculative, parallel),
    )
    config = EngineConfig(
        model,
        cache,
        scheduler,
        args.device,
        args.attention_backend,
        enforce_eager=args.enforce_eager,
        speculative=speculative,
        parallel=parallel,
        lora=resolve_lora(args),
    )
    logger.info("%s", describe_sampling_defaults(model.generation_config, model.sampling_defaults))
    return config, source


def resolve_async_scheduling(args: EngineArgs, speculative: SpeculativeConfig | None, parallel: ParallelConfig) -> bool:
    """--async-scheduling: "on" or "off" as asked, "auto" on CUDA only. Steps that overlap keep a request's
    last token on the device, which speculative decoding (drafts proposed from it on the host), pipeline
    stages (steps of their own in flight) and the second KV tier (blocks copied out on the host) cannot
    work with: "on" with one of them is an error, "auto" turns itself off."""
    if args.async_scheduling not in ASYNC_SCHEDULING:
        raise ValueError(f"unknown async_scheduling {args.async_scheduling!r}; use one of {ASYNC_SCHEDULING}.")
    if args.async_scheduling == "off":
        return False
    conflicts = [
        name
        for name, present in (
            ("speculative decoding", speculative is not None),
            ("pipeline stages", parallel.pipeline_parallel_size > 1),
            ("the second KV tier (--kv-offloading-size)", args.kv_offloading_size is not None),
        )
        if present
    ]
    if args.async_scheduling == "on" and conflicts:
        raise ValueError(f"--async-scheduling on does not work with {' or '.join(conflicts)}; drop one of them.")
    return not conflicts and (args.async_scheduling == "on" or args.device.startswith("cuda"))


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
    """The checked ParallelConfig: the heads split evenly, the layers over the stages, and nothing asked
    that tensor or pipeline parallelism lacks."""
    parallel = ParallelConfig(
        args.tensor_parallel_size,
        args.distributed_executor_backend,
        args.pipeline_parallel_size,
        _partition(args.pp_layer_partition),
    )
    if parallel.pipeline_parallel_size > 1:
        parallel.check_model(hf_config)
        _check_pipeline(args, hf_config, speculative)
    if parallel.world_size > 1:
        parallel.check_model(hf_config)
        if speculative is not None and speculative.method == "draft_model":
            raise ValueError(
                "speculative decoding with a draft model is not supported with tensor_parallel_size > 1; "
                'use {"method": "ngram"} or tensor_parallel_size 1.'
            )
        if args.device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL), not {args.device!r}.")
    return parallel


def _partition(value: str | None) -> tuple[int, ...] | None:
    if value is None or not value.strip():
        return None
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"pp_layer_partition takes layer counts like '3,2', got {value!r}.") from None


def _check_pipeline(args: EngineArgs, hf_config: Any, speculative: SpeculativeConfig | None) -> None:
    """What pipeline parallelism does not serve yet: a clear error before any rank starts."""
    from tokenmill.models.architectures import supports_pipeline  # imports torch: only when asked for

    reason = supports_pipeline(hf_config)
    unsupported = {
        reason or "": reason is not None,
        "speculative decoding": speculative is not None,
        "LoRA adapters": bool(args.enable_lora),
        "the second KV tier (--kv-offloading-size)": bool(args.kv_offloading_size),
    }
    found = [what for what, used in unsupported.items() if used]
    if found:
        raise ValueError(f"pipeline_parallel_size > 1 does not serve {found[0]} (yet); use pipeline_parallel_size 1.")


def resolve_lora(args: EngineArgs) -> LoRAConfig | None:
    """The checked LoRAConfig (None: LoRA off)."""
    if not args.enable_lora:
        return None
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def describe_speculative(spec: SpeculativeConfig | None) -> str:
    """One short phrase for logs and reports, e.g. "ngram k=4 (lookup 2-5, off above 4 running)"."""
    if spec is None:
        return "off"
    how = (
        f"lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max}" if spec.method == "ngram" else f"draft {spec.model}"
    )
    return f"{spec.method} k={spec.num_speculative_tokens} ({how}, off above {spec.disable_by_batch_size} running)"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine, one per EngineArgs field, and `--config`."""
    add_flags(parser, EngineArgs)
    add_config_flag(parser, [EngineArgs])
    add_help_group_flag(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineArgs' fields (except the model) from parsed flags."""
    engine_args = from_namespace(EngineArgs, args)
    return {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "model"}
