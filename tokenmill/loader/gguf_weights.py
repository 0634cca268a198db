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

import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

from tokenmill.loader.gguf import dequantize, unpermute_rope_rows
from tokenmill.loader.gguf_arch import expected_names, hf_name, read_arch, read_config, rope_heads
from tokenmill.quant.gguf import FLOAT_TYPES, repack
from tokenmill.quant.grouped import GroupedWeight


class GGUFWeights:
    """The tensors of one GGUF file by HF name (``model.layers.0.mlp.up_proj.weight``), mapped lazily
    from the file: nothing is read until a tensor is asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"GGUF file not found: {self.path}")
        reader = GGUFReader(self.path)
        self.arch = read_arch(reader)
        self.config = read_config(reader, self.arch)
        self._tensors: dict[str, ReaderTensor] = {hf_name(t.name, self.arch): t for t in reader.tensors}
        missing = sorted(expected_names(self.arch, self.config) - self._tensors.keys())
        if missing:
            raise ValueError(f"the GGUF file is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def is_quantized(self, name: str) -> bool:
        """Whether the tensor is stored in blocks (Q4_0, Q6_K, ...) rather than F32/F16/BF16."""
        return self._tensors[name].tensor_type not in FLOAT_TYPES

    def grouped(self, name: str) -> GroupedWeight:
        """A quantized matrix repacked exactly (ValueError for a type quant/gguf.py does not take),
        its rows in HF order: llama.cpp's q/k interleaving permutes whole output channels, so the
        levels, scales and minimums move with their rows."""
        tensor = self._tensors[name]
        weight = repack(tensor.data, tensor.tensor_type, tensor.name)
        heads = rope_heads(name, self.arch, self.config)
        if heads is None:
            return weight
        minimums = None if weight.minimums is None else unpermute_rope_rows(weight.minimums, heads)
        return GroupedWeight(
            unpermute_rope_rows(weight.levels, heads), unpermute_rope_rows(weight.scales, heads), minimums, weight.bits
        )

    def float_tensor(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in HF layout and row order."""
        weight = dequantize(self._tensors[name])
        heads = rope_heads(name, self.arch, self.config)
        return weight if heads is None else unpermute_rope_rows(weight, heads)

    def float_weights(self, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every tensor not in `skip`, one at a time."""
        for name in self._tensors:
            if name not in skip:
                yield name, self.float_tensor(name)
