"""LoRA adapters (PEFT's format) over a served base model: `LoRARequest` names one for a request, and
adapter.py reads and checks its weights against the base model's layers."""

from tokenmill.lora_request import LoRARequest

__all__ = ["LoRARequest"]
