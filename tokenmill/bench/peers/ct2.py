"""CTranslate2 `generate_batch`, on a folder converted from the same HF weights with its own converter
(which loads the model through transformers and torch, so both go into its virtualenv)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tokenmill.bench.peers.base import TORCH_REQUIREMENT, PeerSpec, SetupStep, converted_weights, venv_python

# The weights' storage type per precision; the driver's compute_type matches it.
QUANTIZATIONS = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_float32"}


def _steps(root: Path) -> list[SetupStep]:
    return [
        SetupStep(
            f"install ctranslate2, transformers and {TORCH_REQUIREMENT} (for its converter)",
            ["{python}", "-m", "pip", "install", TORCH_REQUIREMENT, "ctranslate2", "transformers", "safetensors"],
            check="import ctranslate2, transformers, torch",
        ),
    ]


def _prepare(root: Path, model: Path, dtype: str) -> Path:
    quantization = QUANTIZATIONS[dtype]
    converter = venv_python(root).parent / "ct2-transformers-converter"

    def convert(tmp: Path) -> None:
        command = [str(converter), "--model", str(model), "--output_dir", str(tmp), "--quantization", quantization]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"CTranslate2 conversion failed: {' '.join(command)}\n{proc.stderr[-3000:]}")

    return converted_weights(root, model, f"ct2-{quantization}", convert)


def _env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads)}


SPEC = PeerSpec(
    name="ct2",
    description="CTranslate2 generate_batch, static batches (best batch size reported)",
    driver="ct2_driver.py",
    version_module="ctranslate2",
    dtypes=tuple(QUANTIZATIONS),
    setup_steps=_steps,
    prepare_weights=_prepare,
    driver_env=_env,
)
