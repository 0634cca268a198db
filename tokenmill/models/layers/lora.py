"""A step's LoRA updates on the linear layers they adapt (S-LoRA's idea): the base GEMM runs once for the
whole batch, then each adapter's low-rank update x @ A.T @ B.T is added to its own rows.

The adapters resident at once sit in slots, stacked per layer (tokenmill.lora.slots writes them): a
fused layer (qkv_proj, gate_up_proj) stacks its pieces' A rows one after another, piece i at rows
[i * r, (i + 1) * r) for an adapter of rank r, and its B rows (kept transposed) alike, each piece's B
columns landing on that piece's output columns. The runner orders a step's rows by adapter, so each
adapter's rows are one run [start, end) and its update is two matrix products on views."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.models.layers.linear import silu_and_mul
from tokenmill.ops import packed_gemm
from tokenmill.quant.bf16 import Bf16Linear, PackedFloatLinear
from tokenmill.quant.panels import PANEL

# The highest rank whose updates run in the AMX GEMM's epilogue: there they are float32 FMAs, rank per 16
# outputs of each row, so their cost grows with the rank, while added after the GEMM (a BLAS product, then
# the output read and written again) most of the cost is that second pass. Measured on the embedded model,
# 4 adapters (BENCHMARKS.md): rank 8 in the epilogue 0.84-0.88x the base, after it 0.80x; rank 64 in the
# epilogue 0.46-0.48x, after it 0.53x.
EPILOGUE_MAX_RANK = 16


@dataclass(frozen=True)
class LoRARun:
    """Rows [start, end) of the step run the adapter in `slot`, of rank `rank`."""

    slot: int
    start: int
    end: int
    rank: int


class LoRAContext:
    """Shared by a model's adapted layers: the runs of the step being computed (empty: no adapter)."""

    def __init__(self) -> None:
        self.runs: list[LoRARun] = []
        # The same runs as the fused decode stack takes them: [num_runs, 4] int64 (slot, start, end, rank).
        self.runs_tensor = torch.empty(0, 4, dtype=torch.int64)
        # Per row, as the packed GEMM's LoRA epilogue takes them: [num_rows] int32 slot (-1: none) and rank.
        self.row_slot = torch.empty(0, dtype=torch.int32)
        self.row_rank = torch.empty(0, dtype=torch.int32)
        # The slot of each row of the hidden states the LM head is computing logits for (select_logit_rows).
        self.logit_slot = torch.empty(0, dtype=torch.int32)

    def select_logit_rows(self, index: torch.Tensor | None) -> None:
        """The next logits are of the step's rows `index` ([n] int64; None: every row, in order)."""
        if self.runs:
            self.logit_slot = self.row_slot if index is None else self.row_slot[index.cpu()]

    def set_runs(self, runs: list[LoRARun], num_rows: int = 0) -> None:
        self.runs = runs
        rows = [[r.slot, r.start, r.end, r.rank] for r in runs]
        self.runs_tensor = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        self.row_slot = torch.full((num_rows,), -1, dtype=torch.int32)
        self.row_rank = torch.zeros(num_rows, dtype=torch.int32)
        self.logit_slot = self.row_slot
        for r in runs:
            self.row_slot[r.start : r.end] = r.slot
            self.row_rank[r.start : r.end] = r.rank


class LoRALinear:
    """One linear layer's adapters, stacked by slot: zeros where an adapter leaves the layer alone."""

    def __init__(
        self,
        context: LoRAContext,
        num_slots: int,
        max_rank: int,
        in_features: int,
        piece_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.context = context
        self.piece_sizes = piece_sizes  # output columns of each piece (q, k, v; gate, up; or the one)
        self.pieces = len(piece_sizes)
        rows = self.pieces * max_rank
        ends = [sum(piece_sizes[: i + 1]) for i in range(len(piece_sizes))]
        self.piece_end = torch.tensor(ends, dtype=torch.int64)  # for the packed GEMM's epilogue
        self.whole_panels = all(end % PANEL == 0 for end in ends[:-1])
        self.a = torch.zeros(num_slots, rows, in_features, dtype=dtype, device=device)  # [slots, R, in]
        self.bt = torch.zeros(num_slots, rows, sum(piece_sizes), dtype=dtype, device=device)  # [slots, R, out]
        # bf16 copies, for the fused CPU decode stack: a decode step streams every adapter's weights, and
        # half the bytes is most of its LoRA cost.
        self.a16 = torch.zeros_like(self.a, dtype=torch.bfloat16)
        self.bt16 = torch.zeros_like(self.bt, dtype=torch.bfloat16)

    def write(self, slot: int, rank: int, pieces: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter's (A [rank, in], B [out_piece, rank]) of each piece (None: not adapted) in `slot`."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        col = 0
        for i, (size, ab) in enumerate(zip(self.piece_sizes, pieces)):
            if ab is not None:
                a, b = ab
                self.a[slot, i * rank : (i + 1) * rank].copy_(a)
                self.bt[slot, i * rank : (i + 1) * rank, col : col + size].copy_(b.t())
            col += size
        self.a16[slot].copy_(self.a[slot])
        self.bt16[slot].copy_(self.bt[slot])

    def apply(self, layer: nn.Module, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """layer(x) with the step's updates (then silu(gate) * up of it with silu_mul): in the packed GEMM's
        epilogue where the layer runs bf16 panels on AMX tiles (the output is written once, and [gate | up]
        keeps its activation there), else added after it."""
        if self._in_epilogue(layer, x, silu_mul):
            assert isinstance(layer, PackedFloatLinear)
            t = torch.zeros(x.shape[0], self.a.shape[1], dtype=torch.float32)  # [num_tokens, R]: x A^T
            for run in self.context.runs:
                k = self.pieces * run.rank
                torch.mm(x[run.start : run.end], self.a[run.slot, :k].t(), out=t[run.start : run.end, :k])
            ctx = self.context
            lora = (ctx.row_slot, ctx.row_rank, t, self.bt, self.piece_end)
            return packed_gemm.packed_linear_lora(
                x, layer.packed, layer.ones, layer.bias, layer.out_features, silu_mul, lora
            )
        out = layer(x)
        self.add_to(x, out)
        return silu_and_mul(out) if silu_mul else out

    def _in_epilogue(self, layer: nn.Module, x: torch.Tensor, silu_mul: bool) -> bool:
        return (
            isinstance(layer, Bf16Linear)
            and layer.pairs
            and self.whole_panels
            and x.dtype == torch.float32
            and x.is_contiguous()
            and self.a.dtype == torch.float32
            and packed_gemm.amx()
            and (not silu_mul or layer.out_features % (2 * PANEL) == 0)
            and self.context.row_slot.numel() == x.shape[0]
            and max(run.rank for run in self.context.runs) <= EPILOGUE_MAX_RANK
        )

    def add_to(
        self,
        x: torch.Tensor,  # [num_tokens, in]
        out: torch.Tensor,  # [num_tokens, out], the base layer's output, updated in place
    ) -> None:
        for run in self.context.runs:
            rows = slice(run.start, run.end)
            t = x[rows] @ self.a[run.slot, : self.pieces * run.rank].t()  # [n, pieces * rank]
            col = 0
            for i, size in enumerate(self.piece_sizes):  # each piece's B only on its own columns, in place
                j = slice(i * run.rank, (i + 1) * run.rank)
                out[rows, col : col + size].addmm_(t[:, j], self.bt[run.slot, j, col : col + size])
                col += size


class LoRAHeads:
    """The adapters' updates to the embedding (token i's row gains A[:, i] @ B^T) and to the LM head's
    logits ((h A^T) B^T), stacked by slot. Vocabulary-sized, so allocated only once an adapter that has
    them is written. Under tensor parallelism every rank holds them whole: the embedding's output (after
    its all-reduce) and the gathered logits are the same on every rank, and so are the updates."""

    def __init__(
        self,
        context: LoRAContext,
        num_slots: int,
        max_rank: int,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.context = context
        self.shape = (num_slots, max_rank, vocab_size, hidden_size)
        self.dtype, self.device = dtype, device
        self.ranks = [0] * num_slots
        self.embedding: tuple[torch.Tensor, torch.Tensor] | None = None  # A^T [slots, vocab, R], B^T [slots, R, hidden]
        self.head: tuple[torch.Tensor, torch.Tensor] | None = None  # A [slots, R, hidden], B^T [slots, R, vocab]
        self.has_embedding = [False] * num_slots
        self.has_head = [False] * num_slots

    @property
    def nbytes_per_slot(self) -> int:
        return sum(t[0].nbytes for pair in (self.embedding, self.head) if pair is not None for t in pair)

    def write(
        self,
        slot: int,
        rank: int,
        embedding: tuple[torch.Tensor, torch.Tensor] | None,
        head: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """One adapter's embedding (A [rank, vocab], B [hidden, rank]) and LM head (A [rank, hidden],
        B [vocab, rank]) in `slot` (None: not adapted)."""
        slots, max_rank, vocab, hidden = self.shape
        self.ranks[slot] = rank
        self.has_embedding[slot], self.has_head[slot] = embedding is not None, head is not None
        if embedding is not None and self.embedding is None:
            self.embedding = (self._zeros(slots, vocab, max_rank), self._zeros(slots, max_rank, hidden))
        if head is not None and self.head is None:
            self.head = (self._zeros(slots, max_rank, hidden), self._zeros(slots, max_rank, vocab))
        for held, given, a_transposed in ((self.embedding, embedding, True), (self.head, head, False)):
            if held is None:
                continue
            held[0][slot].zero_()
            held[1][slot].zero_()
            if given is None:
                continue
            a, b = given
            if a_transposed:  # the embedding's A^T: a token's rank values are one row
                held[0][slot, :, :rank].copy_(a.t())
            else:
                held[0][slot, :rank].copy_(a)
            held[1][slot, :rank].copy_(b.t())

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def adapts_embedding(self) -> bool:
        """Some row of the step runs an adapter of the embedding."""
        return self.embedding is not None and any(self.has_embedding[run.slot] for run in self.context.runs)

    def add_to_embedding(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        out: torch.Tensor,  # [num_tokens, hidden], the embedding's output, updated in place
    ) -> None:
        if self.embedding is None:
            return
        at, bt = self.embedding
        for run in self.context.runs:
            if self.has_embedding[run.slot]:
                t = at[run.slot].index_select(0, input_ids[run.start : run.end])[:, : run.rank]  # [n, rank]
                update = t @ bt[run.slot, : run.rank]  # [n, hidden]
                out[run.start : run.end] += update.to(out.dtype)

    def add_to_logits(
        self,
        hidden: torch.Tensor,  # [n, hidden], the rows context.select_logit_rows named
        logits: torch.Tensor,  # [n, vocab] float32, gathered whole, updated in place
    ) -> None:
        if self.head is None or not self.context.runs:
            return
        a, bt = self.head
        slots = self.context.logit_slot
        for slot in {int(s) for s in slots.unique()}:
            if slot < 0 or not self.has_head[slot]:
                continue
            rows = (slots == slot).nonzero().squeeze(1).to(logits.device)  # [m]
            rank = self.ranks[slot]
            t = hidden.index_select(0, rows).to(self.dtype) @ a[slot, :rank].t()  # [m, rank]
            logits.index_add_(0, rows, (t @ bt[slot, :rank]).float())
