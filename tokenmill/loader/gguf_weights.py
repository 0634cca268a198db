"""A GGUF file's tensors under their Hugging Face names, for serving the file as it is quantized
(``--quantization gguf``): quantized matrices as grouped weights (quant/gguf.py), everything else as
float tensors for the model's weight loaders.

    weights = GGUFWeights("model.Q4_K_M.gguf")
    weights.grouped("model.layers.0.self_attn.q_proj.weight")   # GroupedWeight, HF row order
    model.load_weights(weights.float_weights(skip=served_natively))
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

from tokenmill.loader.gguf import dequantize, unpermute_rope_rows
from tokenmill.loader.gguf_arch import (
    expected_names,
    fused_parts,
    hf_name,
    is_weight,
    read_arch,
    read_config,
    rope_heads,
    stored_offset,
)
from tokenmill.quant.gguf import FLOAT_TYPES, repack
from tokenmill.quant.grouped import GroupedWeight


class GGUFWeights:
    """The tensors of one GGUF file by HF name (``model.layers.0.mlp.up_proj.weight``), mapped lazily
    from the file: nothing is read until a tensor is asked for. A fused tensor (Phi-3's qkv_proj,
    gate_up_proj) also answers by its pieces' names (q_proj, ...: its rows), as our fused layers load
    them; `float_weights` yields it whole, under its own name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file not found: {self.path}")
        reader = GGUFReader(self.path)
        self.arch = read_arch(reader)
        self.config = read_config(reader, self.arch)
        self._tensors: dict[str, ReaderTensor] = {
            hf_name(t.name, self.arch): t for t in reader.tensors if is_weight(t.name)
        }
        missing = sorted(expected_names(self.arch, self.config) - self._tensors.keys())
        if missing:
            raise ValueError(f"the GGUF file is missing {len(missing)} tensors, e.g. {missing[:3]}")
        # piece name -> (fused name, first row, rows)
        self._pieces = {
            piece: (name, start, rows)
            for name in self._tensors
            for piece, start, rows in fused_parts(name, self.config)
        }

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._pieces

    def _tensor(self, name: str) -> ReaderTensor:
        return self._tensors[self._pieces[name][0]] if name in self._pieces else self._tensors[name]

    def _rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A piece's rows of its fused tensor (the whole tensor for any other name)."""
        if name not in self._pieces:
            return tensor
        _, start, rows = self._pieces[name]
        return tensor.narrow(0, start, rows).contiguous()

    def is_quantized(self, name: str) -> bool:
        """Whether the tensor is stored in blocks (Q4_0, Q6_K, ...) rather than F32/F16/BF16."""
        return self._tensor(name).tensor_type not in FLOAT_TYPES

    def grouped(self, name: str) -> GroupedWeight:
        """A quantized matrix repacked exactly (ValueError for a type quant/gguf.py does not take),
        its rows in HF order: llama.cpp's q/k interleaving permutes whole output channels, so the
        levels, scales and minimums move with their rows (and a fused tensor's pieces are its rows)."""
        tensor = self._tensor(name)
        weight = repack(tensor.data, tensor.tensor_type, tensor.name)
        heads = rope_heads(name, self.arch, self.config)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return self._rows(name, t if heads is None else unpermute_rope_rows(t, heads))

        minimums = None if weight.minimums is None else rows(weight.minimums)
        return GroupedWeight(rows(weight.levels), rows(weight.scales), minimums, weight.bits)

    def grouped_experts(self, name: str) -> list[GroupedWeight]:
        """A stacked expert tensor ([E, rows, columns], ffn_*_exps) repacked exactly, one per expert."""
        tensor = self._tensor(name)
        num_experts, rows = int(tensor.shape[2]), int(tensor.shape[1])  # ne order: [columns, rows, E]
        data = np.ascontiguousarray(tensor.data).reshape(num_experts, rows, -1)
        return [repack(data[e], tensor.tensor_type, f"{tensor.name}[{e}]") for e in range(num_experts)]

    def float_tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in HF layout and row order."""
        weight = dequantize(self._tensor(name)) - stored_offset(name, self.arch)
        heads = rope_heads(name, self.arch, self.config)
        return self._rows(name, weight if heads is None else unpermute_rope_rows(weight, heads))

    def float_weights(self, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every tensor not in `skip` (a fused one: none of its pieces
        in it), one at a time."""
        for name in self._tensors:
            if name not in skip and not any(piece in skip for piece, _, _ in fused_parts(name, self.config)):
                yield name, self.float_tensor(name)
