"""llama.cpp through llama-cpp-python, built from source (about 8 minutes on 2 cores; `-march=native`, so it
uses whatever SIMD this CPU has). The source distribution is kept, because it ships llama.cpp's own
`convert_hf_to_gguf.py`, which turns the same HF folder into the GGUF the driver loads (f32, bf16 or q8_0;
q4_0 and q4_1 quantized from the f32 file by llama.cpp's own quantizer, `llama_model_quantize`, as
llama-quantize does); the converter's needs (torch, transformers, sentencepiece) go into the same virtualenv.

For `compare --cpu-isa avx2` the ggml CPU backend is built a second time, once, without AVX-512 (AVX2, FMA,
F16C, BMI2: what x86-64-v3 has), next to copies of the other libraries in `lib-avx2/`, and
LLAMA_CPP_LIB_PATH points llama-cpp-python there (about 3 minutes on 2 cores)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tokenmill.bench.peers.base import TORCH_REQUIREMENT, PeerSpec, SetupStep, converted_weights, venv_python

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "q4_0": "q4_0", "q4_1": "q4_1"}
QUANTIZED_FROM_F32 = ("q4_0", "q4_1")  # the converter cannot write these: llama_model_quantize does
_SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"


def source_dir(root: Path) -> Path:
    return root / "src" / _SDIST


def _steps(root: Path) -> list[SetupStep]:
    sdist = root / "sdist" / f"{_SDIST}.tar.gz"
    exists = "import pathlib, sys; sys.exit(0 if pathlib.Path({!r}).exists() else 1)"
    return [
        SetupStep(
            "download the llama-cpp-python source",
            [
                "{python}",
                "-m",
                "pip",
                "download",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(root / "sdist"),
            ],
            check=exists.format(str(sdist)),
        ),
        SetupStep(
            "unpack it (keeps llama.cpp's GGUF converter)",
            ["{python}", "-c", f"import tarfile; tarfile.open({str(sdist)!r}).extractall({str(root / 'src')!r})"],
            check=exists.format(str(source_dir(root) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py")),
        ),
        SetupStep(
            "build and install llama-cpp-python (several minutes)",
            ["{python}", "-m", "pip", "install", "-v", str(source_dir(root))],
            check="import llama_cpp",
            env={"CMAKE_ARGS": "-DLLAVA_BUILD=OFF", "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)},
        ),
        SetupStep(
            "install the GGUF converter's needs",
            [
                "{python}",
                "-m",
                "pip",
                "install",
                TORCH_REQUIREMENT,
                "numpy",
                "sentencepiece",
                "transformers",
                "protobuf",
                "safetensors",
            ],
            check="import torch, numpy, sentencepiece, transformers, safetensors",
        ),
    ]


_CONVERT_WITH_FALLBACK = """
import runpy, sys
script = sys.argv[1]
sys.path.insert(0, script.rsplit("/", 1)[0])
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3].upper())
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) != 0:
    sys.exit("llama_model_quantize failed")
"""


def _prepare(root: Path, model: Path, dtype: str) -> Path:
    outtype = GGUF_TYPES[dtype]
    if outtype in QUANTIZED_FROM_F32:
        f32 = _prepare(root, model, "float32")

        def quantize(tmp: Path) -> None:
            command = [str(venv_python(root)), "-c", _QUANTIZE, str(f32), str(tmp), outtype]
            proc = subprocess.run(command, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{outtype} quantization failed: {' '.join(command)}\n{proc.stderr[-3000:]}")

        return converted_weights(root, model, f"model-{outtype}.gguf", quantize)
    converter = source_dir(root) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"

    def convert(tmp: Path) -> None:
        args = ["--outtype", outtype, "--outfile", str(tmp), str(model)]
        # The converter names the tokenizer's pre-tokenizer from a hash of known tokenizers and refuses
        # others (e.g. a dummy-weights folder with a borrowed tokenizer). The driver sends token ids, so
        # the pre-tokenizer never runs: fall back to GPT-2's name instead of failing.
        command = [str(venv_python(root)), "-c", _CONVERT_WITH_FALLBACK, str(converter), *args]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"GGUF conversion failed: {' '.join(command)}\n{proc.stderr[-3000:]}")

    return converted_weights(root, model, f"model-{outtype}.gguf", convert)


# The ggml CPU backend of an AVX2-only machine (the AVX-512 options are off by default once NATIVE is).
_AVX2_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX_VNNI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
]


def _installed_libs(root: Path) -> Path:
    found = sorted((root / "venv").glob("lib/python*/site-packages/llama_cpp/lib"))
    if not found:
        raise RuntimeError(f"llama-cpp-python's libraries are not under {root / 'venv'}; run setup-peer llamacpp")
    return found[0]


def _avx2_env(root: Path) -> dict[str, str]:
    target = root / "lib-avx2"
    if not (target / "libggml-cpu.so").exists():
        build, tmp = root / "build-avx2", root / f".lib-avx2.tmp-{os.getpid()}"
        source = source_dir(root) / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file() or shutil.which("cmake") is None:
            raise RuntimeError(f"the AVX2 ggml build failed: it needs cmake and llama.cpp's source in {source}")
        jobs = str(os.cpu_count() or 2)
        for command in (
            ["cmake", "-S", str(source), "-B", str(build), *_AVX2_CMAKE_FLAGS],
            ["cmake", "--build", str(build), "--target", "ggml-cpu", "-j", jobs],
        ):
            proc = subprocess.run(command, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"the AVX2 ggml build failed: {' '.join(command)}\n{proc.stderr[-3000:]}")
        shutil.copytree(_installed_libs(root), tmp, symlinks=True)
        for lib in build.rglob("libggml-cpu.so*"):
            (tmp / lib.name).unlink(missing_ok=True)
            shutil.copy2(lib, tmp / lib.name, follow_symlinks=False)
        tmp.rename(target)
    return {"LLAMA_CPP_LIB_PATH": str(target)}


def _env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads)}


SPEC = PeerSpec(
    name="llamacpp",
    description=f"llama.cpp via llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (batched llama_decode)",
    driver="llamacpp_driver.py",
    version_module="llama_cpp",
    dtypes=tuple(GGUF_TYPES),
    setup_steps=_steps,
    prepare_weights=_prepare,
    driver_env=_env,
    avx2_env=_avx2_env,
)
