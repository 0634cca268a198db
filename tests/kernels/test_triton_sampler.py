"""The Triton draw (tokenmill/sample/triton_sample.py) and the sampler on it: the draws follow the row's
distribution, masked tokens never win, and a row's draw depends on its key (a seeded request's seed and
position) alone.

Without a GPU the kernel runs on CPU tensors in Triton's interpreter, at about 10 ms per row and tile:
few rows, vocabularies of one tile except where tiles are the point, and a few hundred draws per
goodness-of-fit test. With CUDA the same tests run compiled on the GPU, with more draws."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.kernels.triton_env import ON_GPU, interpreter_env, skip_unless_interpretable
from tests.unit.test_sampler import EOS, chi_square, draws, sample, seeded
from tokenmill.sample import sampler
from tokenmill.sample.distribution import row_seeds
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import RunnerRequestState

if importlib.util.find_spec("triton") is None:
    pytest.skip(
        "triton is not installed: `pip install -e '.[gpu]'` to run the Triton kernel tests", allow_module_level=True
    )

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
NUM_DRAWS = 20000 if ON_GPU else 120  # per goodness-of-fit test
# 99.9% quantiles of the chi-square distribution (p = 0.001), by degrees of freedom (kept tokens - 1).
CHI2_999 = {3: 16.27, 9: 27.88}


def _import_kernel() -> ModuleType:
    skip_unless_interpretable()
    with interpreter_env():
        return importlib.import_module("tokenmill.sample.triton_sample")


@pytest.fixture(autouse=True, scope="module")
def _interpret_during_tests() -> Iterator[None]:
    with interpreter_env():
        yield


@pytest.fixture
def triton_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler draws with the Triton kernel on whatever device the logits are (CPU: the interpreter)."""
    monkeypatch.setattr(sampler, "use_triton_draw", lambda logits: True)


TS = _import_kernel()


def keys(*seeds: int) -> torch.Tensor:
    return torch.tensor(seeds, dtype=torch.int64, device=DEVICE)


def random_keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def position_key(seed: int, num_tokens: int) -> int:
    """The runner's key for a request of this seed with `num_tokens` tokens so far, as an int64."""
    state = RunnerRequestState(
        req_id="r",
        num_prompt_tokens=1,
        token_ids=[0] * num_tokens,
        sampling_params=SamplingParams(seed=seed),
        block_ids=[],
        num_computed_tokens=0,
    )
    key = state.position_seed(0)
    return key - 2**64 if key >= 2**63 else key


# ---------------------------------------------------------------- the sampled distribution


def test_draws_follow_softmax_of_logits_over_each_rows_temperature() -> None:
    logits = torch.tensor([0.3, -0.15, 0.1, 0.45, -0.3, 0.2, 0.0, -0.05, 0.25, -0.2])
    temperatures = (0.5, 1.0, 2.0)
    # One batch: NUM_DRAWS rows of each temperature.
    temperature = torch.tensor(temperatures).repeat_interleave(NUM_DRAWS).to(DEVICE)
    rows = logits.to(DEVICE).expand(temperature.numel(), -1)
    out = TS.sample_logits(rows, temperature, random_keys(temperature.numel()), block=16).cpu()
    for i, t in enumerate(temperatures):
        samples = out[i * NUM_DRAWS : (i + 1) * NUM_DRAWS]
        assert chi_square(samples, torch.softmax(logits / t, dim=-1)) < CHI2_999[9], f"temperature {t}"


def test_draws_under_top_k_and_top_p_follow_the_kept_tokens_renormalized(triton_draw: None) -> None:
    torch.manual_seed(0)
    logits = torch.tensor([1.2, -1.0, 0.4, 2.0, -0.3, 0.9, 0.1, -2.0, 1.5, 0.6], device=DEVICE)
    samples = draws(logits, SamplingParams(temperature=0.8, top_k=6, top_p=0.85), num=NUM_DRAWS).cpu()
    # softmax(logits / 0.8) puts 0.378, 0.202, 0.139, 0.096, 0.066, 0.051 on tokens 3, 8, 0, 5, 9, 2 (the
    # top 6); renormalized, the mass above token 9 is 0.875 >= 0.85: the nucleus is 3, 8, 0, 5.
    kept = [3, 8, 0, 5]
    assert set(samples.tolist()) <= set(kept)
    expected = torch.softmax(logits.cpu()[kept] / 0.8, dim=-1)
    remapped = torch.tensor([kept.index(t) for t in samples.tolist()])
    assert chi_square(remapped, expected) < CHI2_999[3]


def test_masked_tokens_are_never_drawn_from_logits_or_probabilities() -> None:
    vocab = 40  # three tiles of 16, the last one partial
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    masked = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    masked[::2] = True
    masked[[15, 16, 17, 33]] = True  # around a tile boundary
    logits[:, masked] = float("-inf")
    seeds = random_keys(8)
    # A high temperature flattens the rest: a masked token would have its chances.
    from_logits = TS.sample_logits(logits, torch.full((8,), 3.0, device=DEVICE), seeds, block=16)
    from_probs = TS.sample_probs(torch.softmax(logits * 0.3, dim=-1), seeds, block=16)
    assert not masked[from_logits].any() and not masked[from_probs].any()


def test_a_row_with_all_its_mass_on_one_token_always_draws_it() -> None:
    logits = torch.full((16, 64), float("-inf"), device=DEVICE)
    logits[:, 37] = -5.0
    logits[8:, :37] = -200.0  # weights of e^-195 times the favourite's: never drawn either
    out = TS.sample_logits(logits, torch.ones(16, device=DEVICE), random_keys(16), block=64)
    assert out.tolist() == [37] * 16
    # Every token masked: token 0, as the CPU draw gives.
    assert TS.sample_logits(logits[:1] - float("inf"), None, keys(5), block=64).tolist() == [0]


def test_the_tile_size_does_not_change_the_draw() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    seeds = random_keys(6)
    assert torch.equal(TS.sample_logits(logits, None, seeds, block=16), TS.sample_logits(logits, None, seeds, block=64))


# ---------------------------------------------------------------- keys and seeds


def test_a_key_fixes_the_draw_whatever_the_row_index_and_the_other_rows() -> None:
    logits = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 0.1
    key = position_key(seed=42, num_tokens=17)
    alone = TS.sample_logits(logits[3:4], None, keys(key), block=256).item()
    in_batch = TS.sample_logits(logits, None, keys(11, 12, 13, key, 14, 15), block=256)[3].item()
    order = [5, 3, 1, 0]
    shuffled = TS.sample_logits(logits[order], None, keys(7, key, 8, 9), block=256)[1].item()
    assert in_batch == alone and shuffled == alone


def test_each_position_of_a_seeded_request_draws_from_its_own_stream() -> None:
    logits = torch.zeros(8, 1024, device=DEVICE)  # flat: the winner is the token of the smallest noise
    position_keys = keys(*[position_key(seed=42, num_tokens=n) for n in range(10, 18)])
    out = TS.sample_logits(logits, None, position_keys, block=1024).tolist()
    assert len(set(out)) == 8
    # The same positions draw the same tokens again.
    assert TS.sample_logits(logits, None, position_keys, block=1024).tolist() == out


def test_row_seeds_take_a_seeded_rows_generator_seed_and_fresh_keys_elsewhere() -> None:
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0), SamplingParams(seed=2)]
    generators = [seeded(2**64 - 5), None, seeded(123)]
    meta = SamplingMetadata.build(params, [[0]] * 3, [[]] * 3, generators, [EOS], 8, torch.device("cpu"))
    first, second = row_seeds(meta, 3, torch.device("cpu")), row_seeds(meta, 3, torch.device("cpu"))
    assert first[0].item() == second[0].item() == -5  # 2^64 - 5 as an int64
    assert first[2].item() == second[2].item() == 123
    assert first[1].item() != second[1].item()  # an unseeded row: a new key every step


# ---------------------------------------------------------------- through the Sampler


def test_the_sampler_on_the_triton_draw_keeps_greedy_rows_exact(triton_draw: None) -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    params = [
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
    ]
    out = sample(logits, params, generators=[seeded(3), None, None, None], vocab_size=32)
    assert out[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def test_the_sampler_on_the_triton_draw_repeats_a_seeded_row_whatever_the_batch(triton_draw: None) -> None:
    vocab = 256
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 0.1
    seeds: list[int | None] = [None, 7, 42, None, 9]
    params = [SamplingParams(temperature=0.9, seed=seed) for seed in seeds]

    def draw_of_row_2(rows: list[int]) -> int:
        gens = [None if seeds[r] is None else seeded(seeds[r] or 0) for r in rows]
        out = sample(logits[rows], [params[r] for r in rows], generators=gens, vocab_size=vocab)
        return int(out[rows.index(2)])

    alone = draw_of_row_2([2])
    assert draw_of_row_2([0, 1, 2, 3, 4]) == alone and draw_of_row_2([4, 2, 0]) == alone
    # The row's key is its generator's seed.
    assert alone == TS.sample_logits(logits[2:3], torch.tensor([0.9], device=DEVICE), keys(42)).item()


def test_the_sampler_on_the_triton_draw_leaves_the_callers_logits_unchanged(triton_draw: None) -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)] * 2
    Sampler()(logits, SamplingMetadata.build(params, [[0]] * 4, [[]] * 4, [None] * 4, [EOS], 32, DEVICE))
    assert torch.equal(logits, before)
