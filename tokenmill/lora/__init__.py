"""LoRA adapters (PEFT's format) over a served base model: `LoRARequest` names one for a request;
adapter.py reads and checks its weights against the base model's layers, checker.py does that once per
adapter in the front end, and slots.py keeps the runner's resident adapters in every adapted layer
(models/layers/lora.py adds their updates)."""

from tokenmill.lora_request import LoRARequest

__all__ = ["LoRARequest"]
