"""The fused element-wise Triton kernels (tokenmill/ops/triton_fused.py) equal the PyTorch path they
replace on CUDA, and a decoder layer on that path launches at most 12 kernels.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (as test_triton_attention.py);
the model tests force the Triton path on CPU with `force_triton_ops()`. Tolerances: float32 1e-5 (sums
run in another order); float16 and bfloat16 1 ulp (the math is in the same order, but for the sum of
squares and rsqrt; these cases are bit-equal on the interpreter)."""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.triton_env import ON_GPU, interpreter_env, skip_unless_interpretable
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, _rotate
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.ops.triton_ops import force_triton_ops, triton_ops

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed: `pip install -e '.[gpu]'` to run the Triton kernel tests", allow_module_level=True
    )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _import_kernels() -> dict[str, ModuleType]:
    skip_unless_interpretable()
    with interpreter_env():
        return {
            "fused": importlib.import_module("tokenmill.ops.triton_fused"),
            "backend": importlib.import_module("tokenmill.attention.triton.backend"),
        }


def _round_bf16_to_nearest(convert: Callable[..., Any]) -> Callable[..., Any]:
    """The interpreter truncates float32 to bfloat16 (Triton 3.9); the GPU, like PyTorch, rounds to nearest
    even. Round here too, so that bfloat16 results can be compared bit for bit."""
    import numpy as np
    import triton.language as tl

    def converted(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if src == tl.float32 and dst == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(data))
        return convert(data, src, dst, rounding_mode)

    return converted


@pytest.fixture(autouse=True, scope="module")
def _interpret_during_tests() -> Iterator[None]:
    with interpreter_env(), pytest.MonkeyPatch.context() as mp:
        if not ON_GPU:
            from triton.runtime import interpreter

            mp.setattr(interpreter, "_convert_float", _round_bf16_to_nearest(interpreter._convert_float))
        yield


K = _import_kernels()
fused = K["fused"]


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units in the last place of their (16-bit) dtype."""
    bits = torch.int16

    def ordered(t: torch.Tensor) -> torch.Tensor:  # float bits as integers that sort like the floats
        i = t.contiguous().view(bits).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return int((ordered(a) - ordered(b)).abs().max())


def assert_equal_up_to_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        limit = 1
        assert ulps(out, expected) <= limit, f"{ulps(out, expected)} ulp apart"


def norm_module(hidden: int, dtype: torch.dtype, seed: int = 1) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-6).to(DEVICE)
    norm.weight.data = 1 + 0.3 * randn(hidden, seed=seed)
    return norm.to(dtype)


def test_the_kernels_serve_cuda_tensors_and_cpu_ones_only_when_forced() -> None:
    x = torch.zeros(2, 4)  # a CPU tensor: its C++ (float32) or PyTorch path stays
    assert triton_ops(x) is None
    with force_triton_ops():
        assert triton_ops(x) is fused
        assert triton_ops(x.to(torch.int64)) is None  # not a float the kernels take
    assert triton_ops(x) is None


# ---------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_the_residual_add_then_rmsnorm(dtype: torch.dtype) -> None:
    # 97 wide: not a power of two, so the row's mask cuts the last tile.
    norm = norm_module(97, dtype)
    x, residual = randn(5, 97, dtype=dtype, seed=2), randn(5, 97, dtype=dtype, seed=3)
    expected_residual = x + residual  # the PyTorch path: RMSNorm.forward off the C++ and Triton ones
    expected = norm._norm(expected_residual)
    fused.add_rms_norm_(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    assert_equal_up_to_rounding(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_rows_leaves_its_input(dtype: torch.dtype) -> None:
    norm = norm_module(40, dtype)
    wide = randn(3, 64, dtype=dtype, seed=4)
    x = wide[:, 8:48]  # rows 64 apart
    out = fused.rms_norm(x, norm.weight, norm.eps)
    assert_equal_up_to_rounding(out, norm._norm(x))
    torch.testing.assert_close(wide, randn(3, 64, dtype=dtype, seed=4), atol=0, rtol=0)


def test_rmsnorm_module_takes_the_fused_path_when_forced() -> None:
    norm = norm_module(48, torch.bfloat16)
    x, residual = randn(4, 48, dtype=torch.bfloat16, seed=5), randn(4, 48, dtype=torch.bfloat16, seed=6)
    expected_residual = x + residual
    expected = norm._norm(expected_residual)
    with force_triton_ops():
        out, new_residual = norm(x, residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()  # in place
    assert_equal_up_to_rounding(out, expected)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)


# ---------------------------------------------------------------------------- q/k norm + rotary
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,partial", [(64, 1.0), (80, 1.0), (80, 0.5), (96, 0.75)], ids=["d64", "d80", "d80-half", "d96-3/4"]
)
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk-norm", "rotary-only"])
def test_qk_norm_rope_on_views_of_the_qkv_output(
    dtype: torch.dtype, head_dim: int, partial: float, with_norm: bool
) -> None:
    n, num_heads, num_kv_heads = 3, 3, 1  # 3 query heads: the head tile is padded to 4
    rope = RotaryEmbedding(
        head_dim, 64, {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": partial}
    )
    rotary = rope(torch.tensor([0, 17, 63], device=DEVICE))  # cos, sin: [n, 1, rotary_dim / 2] float32
    qkv = randn(n, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=7)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(n, num_heads, head_dim)  # strided: rows of the fused qkv output
    k = qkv[:, q_size : q_size + kv_size].view(n, num_kv_heads, head_dim)
    q_norm, k_norm = norm_module(head_dim, dtype, seed=8), norm_module(head_dim, dtype, seed=9)

    ref_q, ref_k = (q_norm._norm(q), k_norm._norm(k)) if with_norm else (q, k)
    ref_q, ref_k = _rotate(ref_q, *rotary), _rotate(ref_k, *rotary)  # apply_rotary's PyTorch path
    expected_v = qkv[:, q_size + kv_size :].clone()
    if with_norm:
        fused.qk_norm_rope_(q, k, rotary, q_norm.weight, k_norm.weight, q_norm.eps)
    else:
        fused.qk_norm_rope_(q, k, rotary, None, None, 0.0)
    assert_equal_up_to_rounding(q, ref_q)
    assert_equal_up_to_rounding(k, ref_k)
    torch.testing.assert_close(qkv[:, q_size + kv_size :], expected_v, atol=0, rtol=0)  # v untouched


# ---------------------------------------------------------------------------- SiLU and mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [45, 1100], ids=["one-tile", "two-tiles"])  # tiles of up to 1024 columns
def test_silu_mul_equals_silu_of_gate_times_up(dtype: torch.dtype, inter: int) -> None:
    gate_up = randn(3, 2 * inter, dtype=dtype, seed=10) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert_equal_up_to_rounding(fused.silu_mul(gate_up), F.silu(gate) * up)


# ---------------------------------------------------------------------------- kernel launches per layer
VIEW_OPS = {  # metadata only: no kernel
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "t", "transpose",
    "permute", "expand", "as_strided", "detach", "alias", "unsqueeze", "squeeze", "_reshape_alias",
    "empty", "empty_like", "empty_strided", "new_empty", "lift_fresh",  # allocations, no kernel either
}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Per decoder layer: the ATen ops that launch a kernel, and the Triton kernels launched (the ATen
    ops the interpreter runs inside a launch, to move arguments, do not count)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: int | None = None
        self.in_triton = False
        self.per_layer: dict[int, Counter[str]] = {}

    def record(self, name: str) -> None:
        if self.layer is not None and not self.in_triton:
            self.per_layer.setdefault(self.layer, Counter())[name] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.record(f"aten.{name}")
        return func(*args, **(kwargs or {}))

    def wrap_launch(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def counted(kernel: Any, *args: Any, **kwargs: Any) -> Any:
            self.record(f"triton.{kernel.fn.__name__}")
            outer, self.in_triton = self.in_triton, True
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self.in_triton = outer

        return counted


def tiny_qwen3(dtype: torch.dtype) -> LlamaForCausalLM:
    """Two Qwen3 layers of plain PyTorch modules (no CPU loader: it would swap in packed C++ linears)."""
    config = SimpleNamespace(
        model_type="qwen3", vocab_size=64, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    backend = K["backend"].TritonBackend(DEVICE, num_splits=2)  # split-K decode and its reduce, as long contexts
    model = LlamaForCausalLM(config, backend, max_position=128).to(DEVICE)
    gen = torch.Generator().manual_seed(11)
    for name, param in model.named_parameters():
        init = (
            1 + 0.2 * torch.randn(param.shape, generator=gen)
            if "norm" in name
            else 0.2 * torch.randn(param.shape, generator=gen)
        )
        param.data = init.to(DEVICE)
    model = model.to(dtype)
    model.rotary.reset_buffers(DEVICE)  # float32 tables, as the runner keeps them
    for i, layer in enumerate(model.layers):  # each layer its cache: 4 blocks of 16 slots, random contents
        layer.self_attn.kv_cache = randn(2, 4, 16, 2, 32, dtype=dtype, seed=20 + i)
    return model


def decode_step() -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Two requests decoding their 6th and 21st token (cache blocks [0] and [1, 2])."""
    seq_lens = [6, 21]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([[0, 0], [1, 2]], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor([5, 2 * 16 + 4], dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=[0, 1, 2],
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=21,
    )
    return torch.tensor([3, 9], device=DEVICE), torch.tensor([5, 20], device=DEVICE), meta


def count_launches(model: LlamaForCausalLM) -> tuple[list[Counter[str]], torch.Tensor]:
    """Per decoder layer the kernels one decode step launches, and the step's final hidden states."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    counter = LaunchCounter()
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: setattr(counter, "layer", i))
        layer.register_forward_hook(lambda *_: setattr(counter, "layer", None))
    input_ids, positions, meta = decode_step()
    with pytest.MonkeyPatch.context() as mp, counter, torch.no_grad():
        for cls in (InterpretedFunction, JITFunction):  # the interpreter's launches and compiled ones
            mp.setattr(cls, "run", counter.wrap_launch(cls.run))
        hidden = model(input_ids, positions, meta)
    return [counter.per_layer.get(i, Counter()) for i in range(len(model.layers))], hidden


def describe(counts: list[Counter[str]]) -> str:
    return "; ".join(f"layer {i}: {sum(c.values())} = {dict(sorted(c.items()))}" for i, c in enumerate(counts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_qwen3_decoder_layer_launches_at_most_12_kernels(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path: 4 GEMMs, 2 norms, q/k norm + rotary, SiLU-and-mul, the k/v write and decode attention."""
    with force_triton_ops():
        counts, hidden = count_launches(tiny_qwen3(dtype))
    fused_kernels = ("triton._rms_norm_kernel", "triton._qk_norm_rope_kernel", "triton._silu_mul_kernel")
    for c in counts:
        assert sum(c.values()) <= 12, describe(counts)
        assert [c[k] for k in fused_kernels] == [2, 1, 1], describe(counts)

    # The PyTorch path CUDA took before (the C++ CPU kernels off: CUDA has none) launches more, computes the same.
    for module in ("tokenmill.models.layers.norm", "tokenmill.models.layers.rotary", "tokenmill.models.layers.linear"):
        monkeypatch.setattr(f"{module}.cpu_ops", lambda x: None)
    unfused, expected = count_launches(tiny_qwen3(dtype))
    assert min(sum(c.values()) for c in unfused) > max(sum(c.values()) for c in counts), (
        f"fused: {describe(counts)}\nunfused: {describe(unfused)}"
    )
    # bfloat16: bit-equal on the interpreter; a GPU's 1-ulp differences (rsqrt, sum order) may grow over layers
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(hidden.float(), expected.float(), atol=tol, rtol=tol)
    print(f"\n{dtype} fused: {describe(counts)}\n{dtype} unfused: {describe(unfused)}")
