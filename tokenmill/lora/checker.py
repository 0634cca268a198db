"""The front end's check of a request's LoRA adapter, before it is queued (without torch at import: the
server's process reads an adapter only when a request first names it)."""

from __future__ import annotations

from typing import Any

from tokenmill.lora_request import LoRARequest


class AdapterChecker:
    """Checks each adapter folder against the base model once (adapter.load_adapter's checks); the
    runner reads it again where it runs."""

    def __init__(self, hf_config: Any, max_rank: int) -> None:
        self.hf_config = hf_config
        self.max_rank = max_rank
        self._checked: set[str] = set()  # the adapters' folders

    def check(self, lora: LoRARequest) -> None:
        """A ValueError that says what is wrong with the adapter, else nothing."""
        if lora.lora_path in self._checked:
            return
        import torch

        from tokenmill.lora.adapter import load_adapter

        load_adapter(lora.lora_name, lora.lora_path, self.hf_config, self.max_rank, torch.float32)
        self._checked.add(lora.lora_path)

    def forget(self, lora: LoRARequest) -> None:
        """Check it again next time (its folder may have changed: an unload, then a load)."""
        self._checked.discard(lora.lora_path)
