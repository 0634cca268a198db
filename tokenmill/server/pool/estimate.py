"""How much memory a loaded model is expected to hold: its weights (parameters x bytes per parameter)
plus its engine's KV cache budget. An estimate made before loading, to decide what fits; the engine
process's real footprint adds the runtime (torch, its kernels) on top."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.config import EngineArgs

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int8": 1, "uint8": 1}


def weight_bytes(parameters: int, checkpoint_dtype: str, file_bytes: int, args: EngineArgs) -> int:
    """Parameters x the bytes of the dtype they will be computed in (--dtype, else the checkpoint's);
    a quantized checkpoint (a GGUF file type, say) counts as its file size."""
    dtype = args.dtype if args.dtype in _DTYPE_BYTES else checkpoint_dtype
    per_param = _DTYPE_BYTES.get(dtype)
    if per_param is None or args.quantization is not None:
        return file_bytes
    return parameters * per_param


def kv_cache_bytes(model_path: Path, args: EngineArgs) -> int:
    """The KV cache the engine will allocate: --kv-cache-memory-gb, or --num-kv-blocks blocks of the
    model's per-block size (from its config.json; 0 if it has none, a GGUF say)."""
    if args.num_kv_blocks is None:
        return int(args.kv_cache_memory_gb * GIB)
    config_file = model_path / "config.json"
    if not config_file.is_file():
        return 0
    config = json.loads(config_file.read_text())
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config.get("hidden_size", 0) // max(heads, 1))
    layers = int(config.get("num_hidden_layers", 0))
    dtype_bytes = _DTYPE_BYTES.get(args.dtype if args.dtype != "auto" else "bfloat16", 2)
    per_block = 2 * layers * kv_heads * head_dim * args.block_size * dtype_bytes  # keys and values
    return args.num_kv_blocks * per_block
