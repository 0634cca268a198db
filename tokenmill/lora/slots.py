"""The model runner's resident LoRA adapters: `max_loras` slots stacked in every adapted layer
(models/layers/lora.py), the adapters read from disk kept for reuse (`max_cpu_loras`, least recently
used dropped), and each step's runs of rows per adapter.

The scheduler never runs more than `max_loras` distinct adapters at once, so a step's adapters always
find slots: one already holding it, a free one, or the least recently used one no row of the step needs.

Under tensor parallelism each rank keeps its share, as its base layers are split: a column-parallel
layer's (qkv_proj, gate_up_proj) B rows of its own output columns and all of A; a row-parallel layer's
(o_proj, down_proj) A columns of its own inputs and all of B, so its partial update is summed over the
ranks with the base output's: sum_r (x_r A_r^T) B^T = (x A^T) B^T."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, cast

import torch
from torch import nn

from tokenmill.config import LoRAConfig
from tokenmill.distributed.parallel_state import tp_rank, tp_world_size
from tokenmill.lora.adapter import LoRAAdapter, load_adapter
from tokenmill.lora_request import LoRARequest
from tokenmill.models.layers.lora import LoRAContext, LoRAHeads, LoRALinear, LoRARun

# Each adapted layer's pieces, in its output's column order (the checkpoint's module names).
PIECES = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRASlots:
    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Give every decoder layer of `model` its stacked adapter slots; a ValueError names a layer
        kind that adapters do not serve (a mixture-of-experts block)."""
        self.config = config
        self.hf_config = hf_config
        self.dtype = dtype
        self.context = LoRAContext()
        self.layers: list[dict[str, LoRALinear]] = []
        # Each layer's (module, piece) -> (dim of A or B to narrow, start) of this rank's share.
        self.shards: list[dict[str, tuple[str, int, int]]] = []
        n, r = config.max_loras, config.max_lora_rank
        hidden = int(hf_config.hidden_size)
        world, rank = tp_world_size(), tp_rank()
        for i, layer in enumerate(cast(nn.ModuleList, model.layers)):
            attn, mlp = cast(Any, layer.self_attn), cast(Any, layer.mlp)
            if not hasattr(attn, "qkv_lora") or not hasattr(mlp, "gate_up_lora"):
                raise ValueError(
                    f"LoRA adapters are not served on layer {i}'s {type(mlp).__name__} (mixture-of-experts "
                    "blocks are not adapted yet); serve this model without --enable-lora."
                )
            q, kv = attn.qkv_proj.q_size, attn.qkv_proj.kv_size
            inter = int(hf_config.intermediate_size) // world
            kv_start = (
                rank * attn.num_kv_heads if world <= _kv_heads(hf_config) else rank * _kv_heads(hf_config) // world
            )
            self.shards.append(
                {
                    "q_proj": ("b", rank * q, q),
                    "k_proj": ("b", kv_start * attn.head_dim, kv),
                    "v_proj": ("b", kv_start * attn.head_dim, kv),
                    "gate_proj": ("b", rank * inter, inter),
                    "up_proj": ("b", rank * inter, inter),
                    "o_proj": ("a", rank * q, q),
                    "down_proj": ("a", rank * inter, inter),
                }
            )
            shapes = {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]), "gate_up": (hidden, [inter, inter])}
            shapes["down"] = (inter, [hidden])
            linears = {
                name: LoRALinear(self.context, n, r, k, sizes, dtype, device) for name, (k, sizes) in shapes.items()
            }
            attn.qkv_lora, attn.o_lora = linears["qkv"], linears["o"]
            mlp.gate_up_lora, mlp.down_lora = linears["gate_up"], linears["down"]
            self.layers.append(linears)
        # The embedding's and LM head's updates: the embedding's output gains them through a hook (every
        # model calls its embed_tokens), the logits in the model's compute_logits (before a soft cap).
        vocab = int(hf_config.vocab_size)
        self.heads = LoRAHeads(self.context, n, r, vocab, hidden, dtype, device)
        embed_tokens = cast(nn.Module, model.embed_tokens)
        embed_tokens.register_forward_hook(lambda _, args, out: self.heads.add_to_embedding(args[0], out))
        cast(Any, model).lora_heads = self.heads
        self.resident: list[LoRARequest | None] = [None] * n  # the adapter in each slot
        self.ranks = [0] * n
        self.last_used = [0] * n  # the step each slot last ran in (least recently used goes first)
        self.num_steps = 0
        self.read: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # most recently used last

    @property
    def nbytes_per_slot(self) -> int:
        layers = sum(w.a[0].nbytes + w.bt[0].nbytes for layer in self.layers for w in layer.values())
        return layers + self.heads.nbytes_per_slot

    def begin_step(self, loras: list[LoRARequest | None], num_rows: list[int]) -> bool:
        """Make the step's adapters resident and tell the adapted layers whose rows run which: request i
        has `num_rows[i]` rows, after request i - 1's, and runs `loras[i]` (requests of one adapter
        next to each other). False when no row runs an adapter."""
        self.num_steps += 1
        runs: list[LoRARun] = []
        start = 0
        needed = {lora for lora in loras if lora is not None}
        for lora, rows in zip(loras, num_rows):
            if lora is not None:
                slot = self._slot_of(lora, needed)
                if runs and runs[-1].slot == slot and runs[-1].end == start:
                    last = runs[-1]
                    runs[-1] = LoRARun(slot, last.start, start + rows, last.rank)
                else:
                    runs.append(LoRARun(slot, start, start + rows, self.ranks[slot]))
            start += rows
        self.context.set_runs(runs, start)
        return bool(runs)

    def end_step(self) -> None:
        if self.context.runs:
            self.context.set_runs([])

    def _slot_of(self, lora: LoRARequest, needed: set[LoRARequest]) -> int:
        if lora in self.resident:
            slot = self.resident.index(lora)
        else:
            free = [i for i, held in enumerate(self.resident) if held is None or held not in needed]
            if not free:  # the scheduler admits at most max_loras adapters at once
                raise RuntimeError(f"a step runs more than max_loras={self.config.max_loras} LoRA adapters")
            slot = min(free, key=lambda i: (self.resident[i] is not None, self.last_used[i]))
            self._write(slot, lora)
        self.last_used[slot] = self.num_steps
        return slot

    def _write(self, slot: int, lora: LoRARequest) -> None:
        adapter = self._read(lora)
        for linears, shards, weights in zip(self.layers, self.shards, adapter.layers):
            for name, linear in linears.items():
                pieces: list[tuple[torch.Tensor, torch.Tensor] | None] = []
                for piece in PIECES[name]:
                    w = weights.get(piece)
                    if w is None:
                        pieces.append(None)
                        continue
                    which, start, size = shards[piece]  # this rank's share (all of it at world size 1)
                    a = w.a.narrow(1, start, size) if which == "a" else w.a
                    b = w.b.narrow(0, start, size) if which == "b" else w.b
                    pieces.append((a, b))
                linear.write(slot, adapter.rank, pieces)
        heads = {name: (w.a, w.b) for name, w in adapter.heads.items()}
        self.heads.write(slot, adapter.rank, heads.get("embed_tokens"), heads.get("lm_head"))
        self.resident[slot] = lora
        self.ranks[slot] = adapter.rank

    def _read(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self.read.pop(lora, None)
        if adapter is None:
            adapter = load_adapter(
                lora.lora_name, lora.lora_path, self.hf_config, self.config.max_lora_rank, self.dtype
            )
        self.read[lora] = adapter
        while len(self.read) > self.config.cpu_loras:
            self.read.popitem(last=False)
        return adapter


def _kv_heads(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
