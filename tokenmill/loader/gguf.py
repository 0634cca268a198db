"""Read GGUF files (Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2; see gguf_arch.py) as Hugging Face tensors, and write
them out as a plain HF folder.

Usage::

    from tokenmill.loader.gguf import gguf_to_hf_folder
    folder = gguf_to_hf_folder("model.Q4_1.gguf", "/tmp/model")  # config.json, model.safetensors, tokenizer
    # AutoModelForCausalLM.from_pretrained(folder) now works, and so does tokenmill.

Quantized tensors are dequantized with ``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, the K-quants, ...), then cast to the requested dtype.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor
from safetensors.torch import save_file

from tokenmill.loader.gguf_arch import (
    expected_names,
    field,
    hf_name,
    is_weight,
    read_arch,
    read_config,
    rope_heads,
    stored_offset,
)

# llama.cpp pre-tokenizers that split every digit on its own before the GPT-2 regex; transformers'
# GGUF tokenizer conversion drops that split, so numbers would tokenize differently from training.
_DIGIT_SPLIT_PRE_TOKENIZERS = frozenset({"smollm", "starcoder", "refact", "codeshell"})

# Keys transformers' save_pretrained writes that describe how it was loaded, not the tokenizer.
_LOAD_TIME_TOKENIZER_KEYS = ("is_local", "local_files_only")


class GGUFCheckpoint(NamedTuple):
    state_dict: dict[str, torch.Tensor]  # HF names -> tensors in torch (row-major) layout
    config: dict[str, Any]  # config.json contents (LlamaForCausalLM, Qwen2ForCausalLM, ...)


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: interleaved rotary pairs back to HF's rotate_half halves.

    Within each head, llama.cpp stores output row ``2*j + h`` for HF row ``h * head_dim/2 + j``
    (h = 0 for the first half, 1 for the second), so rotary pairs are adjacent rows.
    """
    rows = weight.shape[0]
    if num_heads <= 0 or rows % (2 * num_heads) != 0:
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even head_dim")
    half = rows // num_heads // 2
    # [num_heads, half, 2, ...] -> [num_heads, 2, half, ...]
    pairs = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


def _load_checkpoint(reader: GGUFReader, dtype: torch.dtype) -> GGUFCheckpoint:
    """The file's tensors under HF names (dequantized, cast to ``dtype``) and its HF config."""
    arch = read_arch(reader)
    config = read_config(reader, arch)
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in filter(lambda t: is_weight(t.name), reader.tensors):
        name = hf_name(tensor.name, arch)
        weight = dequantize(tensor)
        heads = rope_heads(name, arch, config)
        if heads is not None:
            weight = unpermute_rope_rows(weight, heads)
        state_dict[name] = (weight - stored_offset(name, arch)).to(dtype)
    missing = sorted(expected_names(arch, config) - state_dict.keys())
    if missing:
        raise ValueError(f"the GGUF file is missing {len(missing)} tensors, e.g. {missing[:3]}")
    _stack_gate_up(state_dict)
    return GGUFCheckpoint(state_dict, config)


def _stack_gate_up(state_dict: dict[str, torch.Tensor]) -> None:
    """Experts' gate and up ([E, I, H] each in the file) as transformers 5 saves them: one gate_up_proj
    [E, 2 I, H], gate rows first, so the expanded folder loads in transformers too."""
    for gate_name in [name for name in state_dict if name.endswith(".mlp.experts.gate_proj")]:
        prefix = gate_name.removesuffix("gate_proj")
        state_dict[f"{prefix}gate_up_proj"] = torch.cat(
            [state_dict.pop(gate_name), state_dict.pop(f"{prefix}up_proj")], 1
        )


def gguf_to_hf_folder(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, weights: bool = True
) -> Path:
    """Convert a GGUF file into a Hugging Face folder at ``out_dir`` and return its path.

    Writes config.json, model.safetensors (unless ``weights`` is False: a folder for a model whose
    weights are read from the GGUF itself, ``--quantization gguf``), tokenizer.json, tokenizer_config.json
    (with the GGUF chat template) and generation_config.json into a temporary sibling folder, then
    renames it into place, so ``out_dir`` either does not exist or is complete.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists():
        raise ValueError(f"{out_dir} already exists; delete it or pick another output folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        reader = GGUFReader(gguf_path)  # parsing the metadata takes seconds: do it once
        if weights:
            state_dict, config = _load_checkpoint(reader, dtype)
            save_file(state_dict, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
            del state_dict  # free the weights before the tokenizer conversion loads its own copy of the vocab
        else:
            config = read_config(reader, read_arch(reader))
        _write_json(tmp_dir / "config.json", {**config, "dtype": str(dtype).removeprefix("torch.")})
        _write_json(tmp_dir / "generation_config.json", _generation_config(config))
        _write_tokenizer(reader, gguf_path, tmp_dir, config["max_position_embeddings"])
        _make_readable(tmp_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as float32 in torch layout [rows, columns], by gguf's own dequantization."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"tensor {tensor.name} uses {tensor.tensor_type.name}, which the installed gguf package "
            "cannot dequantize; upgrade it with `pip install -U gguf`"
        ) from e
    values = values.astype(np.float32, copy=False)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
        values = values.copy()
    # GGUF lists dimensions fastest-varying first (ne order); torch wants them slowest first.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(values.reshape(shape))


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config[key] is not None}


def _write_tokenizer(reader: GGUFReader, gguf_path: Path, out_dir: Path, max_length: int) -> None:
    from tokenizers import pre_tokenizers  # imported here: serving a GGUF's weights needs no tokenizer library

    pre = field(reader, "tokenizer.ggml.pre", "default")
    chat_template = field(reader, "tokenizer.chat_template", "")
    tokenizer = _gguf_tokenizer(gguf_path)
    if not tokenizer.is_fast:
        raise ValueError(f"transformers built a slow tokenizer for {gguf_path}; a fast one is required")
    if pre in _DIGIT_SPLIT_PRE_TOKENIZERS:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )
    if chat_template:
        tokenizer.chat_template = chat_template
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)

    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    for key in _LOAD_TIME_TOKENIZER_KEYS:
        tokenizer_config.pop(key, None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # plain tokenizer.json, any version
    tokenizer_config["model_max_length"] = max_length
    _write_json(config_path, tokenizer_config)


def _gguf_tokenizer(gguf_path: Path) -> Any:
    """transformers' tokenizer of the file: AutoTokenizer's class where transformers reads the file's
    architecture (it picks the class by the model config), else the plain fast tokenizer built from the
    same tokenizer metadata (OLMo 2, GraniteMoe, ... whose GGUF configs transformers does not read)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ValueError as exc:
        if "is not supported yet" not in str(exc):
            raise
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)


def _make_readable(folder: Path) -> None:
    # mkdtemp (and safetensors) create owner-only entries; a model folder is ordinary shared data.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
