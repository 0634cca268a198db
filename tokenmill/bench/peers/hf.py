"""HF transformers `generate` with static batches, in a virtualenv of its own (latest transformers, our torch)."""

from __future__ import annotations

from pathlib import Path

from tokenmill.bench.peers.base import TORCH_REQUIREMENT, PeerSpec, SetupStep


def _steps(root: Path) -> list[SetupStep]:
    return [
        SetupStep(
            f"install {TORCH_REQUIREMENT} and transformers",
            ["{python}", "-m", "pip", "install", TORCH_REQUIREMENT, "transformers", "safetensors"],
            check="import torch, transformers, safetensors",
        ),
    ]


def _env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads)}


SPEC = PeerSpec(
    name="hf",
    description="HF transformers generate, static batches (best batch size reported)",
    driver="hf_driver.py",
    version_module="transformers",
    dtypes=("float32", "bfloat16"),
    setup_steps=_steps,
    driver_env=_env,
)
