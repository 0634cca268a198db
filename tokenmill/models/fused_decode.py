"""Every decoder layer of a CPU decode step in one C++ call (ops/csrc/decode_stack.cpp).

A decode step of a small model at batch 1 issues ~15 PyTorch calls per layer; from Python they cost
about as much as the weight streaming they wrap. The C++ stack runs the same kernels on the same
weights and KV cache, so the numbers match the layer-by-layer path (tests/e2e/test_fused_decode.py);
it starts from the token ids (the embedding lookup and the rotary tables' rows are in the call too).
It covers the common case: float32 or packed (bf16, int8, int4) weights on CPU, float32 activations, a
float32, bf16 or int8 cache, the C++ paged-decode attention, no q/k norm (Qwen3 keeps the Python path).
A step whose requests have up to MAX_QUERY_LEN query tokens each (decode rows, speculative decoding's
verification steps, short prompt chunks) runs here, causal within each request's query; longer
chunks run layer by layer. Under tensor parallelism each rank runs the stack on its shard, and the C++
step calls back into Python for the vocab-parallel embedding lookup and the all-reduces after o_proj
and down_proj (as the layer-by-layer path does)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.distributed.communication import all_reduce_
from tokenmill.distributed.parallel_state import tp_world_size
from tokenmill.models.layers.lora import LoRALinear
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.ops import build
from tokenmill.quant.bf16 import PackedFloatLinear
from tokenmill.quant.grouped import GroupedLinear
from tokenmill.quant.int8 import Int8Linear


def _packed(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """(packed weight, scale, bias, out_features) of a layer our packed GEMM runs, or (float32 weight,
    empty, bias or empty, out_features) of a float32 nn.Linear; else None."""
    if isinstance(layer, PackedFloatLinear):
        return layer.packed, layer.ones, layer.bias, layer.out_features
    if isinstance(layer, Int8Linear) and layer.kernel == "cpu" and layer.bias is not None:
        return layer.qweight, layer.scale, layer.bias, layer.out_features
    if isinstance(layer, GroupedLinear) and layer.kernel == "cpu":  # its group scales in the scale's place
        return layer.qweight, layer.params, layer.bias, layer.out_features
    if isinstance(layer, nn.Linear) and layer.weight.dtype == torch.float32:
        none = torch.empty(0)
        return layer.weight, none, none if layer.bias is None else layer.bias, layer.out_features
    return None


def unsupported_reason(model: LlamaForCausalLM) -> str | None:
    """Why `model` cannot use the fused decode stack, or None when it can."""
    if model.embed_tokens.weight.device.type != "cpu" or model.embed_tokens.weight.dtype != torch.float32:
        return "not float32 on CPU"
    if model.backend.name != "cpu":
        return f"attention backend {model.backend.name!r} is not the C++ CPU one"
    if model.rotary.rotary_dim != model.rotary.head_dim:
        return "partial rotary (Phi-4-mini) is not fused"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None:
            return "q/k norm (Qwen3, OLMo 2) is not fused"
        if attn.sliding_window is not None:
            return "sliding-window layers (Phi-3-mini) are not fused"
        if any(_packed(m) is None for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "linear layers are neither float32 nor packed for the C++ GEMM"
    if build.load("decode_stack") is None:
        return "the C++ decode stack could not be built"
    return None


class FusedDecode:
    """Built for one model; rebuilt on the next call when the runner binds new KV caches."""

    # Query tokens per request the C++ stack takes (kMaxQueryLen in decode_stack.cpp): a verification
    # step's 1 + k, k up to 8 draft tokens.
    MAX_QUERY_LEN = 9

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self._stack: Any = None
        self._caches: list[torch.Tensor] = []
        self._loras: list[dict[str, LoRALinear]] = []

    def bind_loras(self, layers: list[dict[str, LoRALinear]]) -> None:
        """Each layer's LoRA slots (qkv, o, gate_up, down: tokenmill.lora.slots), read in place by steps
        that pass runs of adapted rows."""
        self._loras = layers
        self._stack = None

    def _bind(self, caches: list[torch.Tensor]) -> Any:
        model = self.model
        attn0 = model.layers[0].self_attn
        kernels = build.load("decode_stack")
        stack = kernels.DecodeStack(
            attn0.num_heads,
            attn0.num_kv_heads,
            attn0.head_dim,
            model.norm.eps,
            attn0.scale,
            model.norm.weight,
            model.embed_tokens.weight,
            model.rotary.cos,
            model.rotary.sin,
        )
        for layer, cache in zip(model.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                _packed(attn.qkv_proj),
                _packed(attn.o_proj),
                _packed(mlp.gate_up_proj),
                _packed(mlp.down_proj),
                cache,
            )
        for i, linears in enumerate(self._loras):
            slots = [(linears[n].a16, linears[n].bt16, linears[n].piece_sizes) for n in ("qkv", "o", "gate_up", "down")]
            stack.set_lora(i, slots)
        if tp_world_size() > 1:  # the C++ step calls back for the vocab-parallel lookup and the all-reduces
            stack.set_tensor_parallel(all_reduce_, model.embed_tokens)
        self._caches = caches
        return stack

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] each request's query tokens, request by request
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,  # at most MAX_QUERY_LEN query tokens per request
        lora_runs: torch.Tensor | None = None,  # [num_runs, 4] int64 (slot, start, end, rank): adapted rows
    ) -> torch.Tensor:
        """The final normed hidden states, [num_tokens, hidden]."""
        caches = [layer.self_attn.kv_cache for layer in self.model.layers]
        if any(c is None for c in caches):
            raise RuntimeError("the KV cache was not bound to the attention layers")
        if caches[0].dtype not in (torch.float32, torch.bfloat16, torch.int8):
            raise RuntimeError(f"the fused decode stack reads a float32, bf16 or int8 KV cache, not {caches[0].dtype}")
        if self._stack is None or any(a is not b for a, b in zip(caches, self._caches)):
            self._stack = self._bind(caches)
        args = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if lora_runs is not None and lora_runs.numel():
            return self._stack.forward_lora(*args, lora_runs)
        return self._stack.forward(*args)
