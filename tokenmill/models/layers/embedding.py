"""The token embedding and the LM head, split by vocabulary rows across tensor-parallel ranks.

The vocabulary is padded to a multiple of the world size; rank r holds rows [r * V/N, (r + 1) * V/N).
The lookup zeroes the rows of tokens another rank holds and all-reduces; the head computes this rank's
logit columns and all-gathers them, then cuts the padding. At world size 1 both are the plain ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.communication import all_gather_last, all_reduce_
from tokenmill.distributed.parallel_state import tp_rank, tp_world_size
from tokenmill.models.layers.linear import Linear


def vocab_shard(vocab_size: int) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's vocabulary slice, padding included."""
    n = tp_world_size()
    per_rank = -(-vocab_size // n)
    return tp_rank() * per_rank, per_rank


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, vocab_size: int, start: int) -> None:
    """param [V/N, hidden] <- loaded[start : start + V/N] of [V, hidden]; padding rows are zero."""
    per_rank = param.shape[0]
    if loaded.shape[0] != vocab_size or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit [{vocab_size}, ...]")
    real = max(0, min(per_rank, vocab_size - start))
    param.data[:real].copy_(loaded.narrow(0, start, real))
    param.data[real:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_size = vocab_size
        self.vocab_start, per_rank = vocab_shard(vocab_size)
        super().__init__(per_rank, hidden_size)
        self.parallel = tp_world_size() > 1

    def reset_parameters(self) -> None:
        """No random init (see Linear.reset_parameters)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if not self.parallel:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)  # [num_tokens]
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return all_reduce_(out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start)


class ParallelLMHead(Linear):
    """This rank's rows of the [vocab, hidden] head; `gather_logits` joins the ranks' columns."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.vocab_start, per_rank = vocab_shard(vocab_size)
        super().__init__(hidden_size, per_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        load_vocab_rows(param, loaded, self.vocab_size, self.vocab_start)


def gather_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, V/N] of this rank -> [n, V]: every rank's columns, the padding cut."""
    if tp_world_size() == 1:
        return logits
    return all_gather_last(logits)[:, :vocab_size]
