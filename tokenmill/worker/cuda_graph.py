"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; replaying them as one captured graph removes the
CPU launch cost that otherwise bounds small-batch decode. One graph is captured per batch-size
bucket, all reading persistent input buffers; each step copies its inputs into them, pads up to the
bucket, replays, and returns the first `num_reqs` rows of the graph's static output.

Padding rows: slot_mapping = pad_slot_id (-1 by default, which the Triton KV-write kernel skips;
a backend that cannot skip needs a reserved block's slot here), seq_len 1, token 0 at position 0.
Their outputs are computed and ignored.

Graph safety rests on the attention backend's decode path reading only device tensors plus
q.shape[0] and meta.max_seq_len: graphs are captured with max_seq_len = max_model_len (see
tokenmill.attention.triton.backend). The KV cache must stay where it was at capture.

Use (from the model runner, after the KV cache is allocated):
    graphs = CudaGraphRunner(model, max_num_seqs, max_model_len, block_size, hidden_size, dtype, device)
    graphs.capture()
    hidden = graphs.run(batch) if graphs.can_run(batch) else model(batch.input_ids, ...)
`--enforce-eager` means: never build one."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.worker.input_batch import StepBatch
from tokenmill.worker.model_interface import CausalLM

logger = logging.getLogger(__name__)

PAD_SLOT_ID = -1


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32 (padding wastes at most 31 rows), up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
    sizes = [s for s in (1, 2, 4, 8, 16) if s < max_num_seqs]
    sizes += range(32, max_num_seqs, 32)
    return sorted(set(sizes) | {max_num_seqs})


@dataclass(frozen=True)
class CaptureStats:
    batch_sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs' pool took (free memory before - after)


class CudaGraphRunner:
    def __init__(
        self,
        model: CausalLM,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        pad_slot_id: int = PAD_SLOT_ID,
        batch_sizes: list[int] | None = None,
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.pad_slot_id = pad_slot_id
        self.batch_sizes = sorted(batch_sizes or batch_size_buckets(max_num_seqs))
        self.max_batch_size = self.batch_sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        n = self.max_batch_size
        # Persistent inputs: every graph reads prefixes of these.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.slot_mapping = torch.full((n,), pad_slot_id, dtype=torch.int64, device=device)  # [max_bs]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_bs]
        self.block_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # decode: one token each
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> the graph's static [bs, hidden] output

    # ------------------------------------------------------------------ capture
    def _metadata(self, batch_size: int) -> AttentionMetadata:
        """Views of the persistent buffers; host fields describe the worst case (see module docstring)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc_cpu=list(range(batch_size + 1)),
            seq_lens_cpu=[self.max_model_len] * batch_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, batch_size: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch_size], self.positions[:batch_size], self._metadata(batch_size))

    @torch.inference_mode()
    def capture(self) -> CaptureStats:
        """Capture one graph per bucket, largest first (the shared pool is sized by the first)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}; use --enforce-eager.")
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.batch_sizes):
            self._forward(batch_size)  # warm-up: compiles this bucket's kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch_size] = self._forward(batch_size)
            self.graphs[batch_size] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        stats = CaptureStats(list(self.batch_sizes), time.perf_counter() - start, free_before - free_after)
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %s in %.2f s, %.0f MiB",
            len(self.graphs),
            stats.batch_sizes,
            stats.seconds,
            stats.memory_bytes / 2**20,
        )
        return stats

    # ------------------------------------------------------------------ replay
    def can_run(self, batch: StepBatch) -> bool:
        """The graphs are captured and one of them fits the batch (see `fits`)."""
        return bool(self.graphs) and self.fits(batch)

    def fits(self, batch: StepBatch) -> bool:
        """Every request decodes one token, and the batch and its contexts fit the persistent buffers."""
        meta = batch.attn_metadata
        return (
            meta.is_all_decode
            and meta.num_tokens == meta.num_reqs
            and meta.num_reqs <= self.max_batch_size
            and meta.max_seq_len <= self.max_model_len
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def bucket_for(self, num_reqs: int) -> int:
        return next(s for s in self.batch_sizes if s >= num_reqs)

    def prepare(self, batch: StepBatch) -> int:
        """Copy the step's inputs into the persistent buffers and pad them to the bucket; returns its size."""
        meta = batch.attn_metadata
        n = meta.num_reqs
        batch_size = self.bucket_for(n)
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        # Columns past this step's width keep stale ids: never read, as no context reaches them.
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if batch_size > n:
            self.input_ids[n:batch_size].zero_()
            self.positions[n:batch_size].zero_()
            self.slot_mapping[n:batch_size].fill_(self.pad_slot_id)
            self.seq_lens[n:batch_size].fill_(1)
            self.block_tables[n:batch_size, 0].zero_()  # a pad row reads one key, from block 0: any finite value
        return batch_size

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The model's hidden states for the batch, [num_reqs, hidden_size]: a view of the graph's static
        output, valid until the next replay of the same bucket."""
        batch_size = self.prepare(batch)
        self.graphs[batch_size].replay()
        return self.outputs[batch_size][: batch.attn_metadata.num_reqs]
