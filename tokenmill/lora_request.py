"""Which LoRA adapter a request runs with (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: how clients name the adapter (the `model` field on the server); `lora_int_id`: a unique
    id >= 1 (0 is the base model); `lora_path`: the adapter's folder (adapter_config.json and
    adapter_model.safetensors, as PEFT saves them)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a non-empty lora_name.")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}.")
