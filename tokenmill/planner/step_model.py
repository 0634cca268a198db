"""What one engine step costs, measured by `tokenmill bench calibrate` and read back from its JSON profile
(offline: the engine alone; with --server: fitted to a live server's steps, step_fit.py).

A step runs `rows` decode rows (one token each) and `prefill_tokens` prompt tokens; its wall time is modelled as

    seconds = decode_base_s + decode_per_row_s x rows + prefill_per_token_s x prefill_tokens

(a decode step's fixed cost: weights streamed once, Python and sampling; each row's GEMM rows and attention; each
prompt token's GEMM rows). The profile also carries the engine's batch limits and the calibrated workload's
(prompt, output) lengths, so the simulator replays the same mix the measurement will send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILE_HINT = "pass a file written by `tokenmill bench calibrate --output-json FILE.json`"


@dataclass(frozen=True)
class StepCosts:
    """The step-time model and the scheduler limits it was measured under."""

    decode_base_s: float
    decode_per_row_s: float
    prefill_per_token_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    # The workload's share of prompt tokens found in the prefix cache (the KV cache, or its second tier
    # with --kv-offloading-size): never computed; each costs `cached_load_per_token_s` to read back (0 for
    # the KV cache's own blocks; a tier's load time per token, e.g. kv_tier_load_seconds / hit_tokens).
    cached_prompt_share: float = 0.0
    cached_load_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.decode_base_s > 0 or not self.decode_per_row_s >= 0 or not self.prefill_per_token_s >= 0:
            raise ValueError(
                f"a step's base cost must be > 0 and its per-row and per-token costs >= 0 (got "
                f"{self.decode_base_s}, {self.decode_per_row_s}, {self.prefill_per_token_s}); {PROFILE_HINT}."
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1.")
        if not 0.0 <= self.cached_prompt_share < 1.0 or not self.cached_load_per_token_s >= 0:
            raise ValueError(
                f"--cached-prompt-share is a share in [0, 1) and --cached-load-us >= 0 (got "
                f"{self.cached_prompt_share}, {self.cached_load_per_token_s * 1e6:g})."
            )

    def cached_tokens(self, prompt: int) -> int:
        """Of a `prompt`-token prompt, the tokens found in the prefix cache (its last is always computed)."""
        return min(prompt - 1, int(prompt * self.cached_prompt_share))

    def step_seconds(self, rows: int, prefill_tokens: int) -> float:
        return self.decode_base_s + self.decode_per_row_s * rows + self.prefill_per_token_s * prefill_tokens


@dataclass(frozen=True)
class Profile:
    """A calibration: the step costs, the workload's lengths, and where they were measured."""

    path: str
    costs: StepCosts
    lengths: list[tuple[int, int]]  # (prompt tokens, output tokens) per request of the calibrated workload
    workload: str
    model: str

    @property
    def avg_input_tokens(self) -> float:
        return sum(p for p, _ in self.lengths) / len(self.lengths)

    @property
    def avg_output_tokens(self) -> float:
        return sum(o for _, o in self.lengths) / len(self.lengths)


def load_profile(path: str | Path) -> Profile:
    """The calibration in `path` (see `tokenmill bench calibrate`); a clear ValueError when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read --profile {path}: {exc.strerror}; {PROFILE_HINT}.") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--profile {path} is not JSON ({exc.msg}); {PROFILE_HINT}.") from exc
    if not isinstance(data, dict) or not isinstance(data.get("step_costs"), dict):
        raise ValueError(f'--profile {path} has no "step_costs" object; {PROFILE_HINT}.')
    costs: dict[str, Any] = data["step_costs"]
    try:
        step = StepCosts(
            decode_base_s=float(costs["decode_base_s"]),
            decode_per_row_s=float(costs["decode_per_row_s"]),
            prefill_per_token_s=float(costs["prefill_per_token_s"]),
            max_num_seqs=int(costs["max_num_seqs"]),
            max_num_batched_tokens=int(costs["max_num_batched_tokens"]),
        )
        lengths = [(int(p), int(o)) for p, o in data["lengths"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--profile {path} is incomplete ({exc!r}); {PROFILE_HINT}.") from exc
    if not lengths or any(p < 1 or o < 1 for p, o in lengths):
        raise ValueError(f"--profile {path} has no valid (prompt, output) lengths; {PROFILE_HINT}.")
    return Profile(str(path), step, lengths, str(data.get("workload", "?")), str(data.get("model", "?")))
