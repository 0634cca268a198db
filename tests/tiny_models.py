"""Tiny random models of each supported family, saved as real HF folders, and HF references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenmill.sampling_params import SamplingParams

# Small but not trivial: GQA (4 query heads on 2 KV heads), several blocks per prompt.
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # Wider than the default 0.02 so logits are far apart and greedy ties cannot flip between
    # two correct implementations that round differently.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama-tied-rope-scaling": dict(
        model_type="llama",
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=32),
    # Mixture-of-experts (models/moe.py): 4-8 experts, top-2, narrow experts.
    "qwen2-moe": dict(  # QKV bias, a gated shared expert, layer 1 a dense MLP
        model_type="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
    ),
    "qwen3-moe": dict(
        model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "granitemoe": dict(  # tied head; every multiplier away from 1
        model_type="granitemoe",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        tie_word_embeddings=True,
        embedding_multiplier=2.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=2.0,
    ),
    # Sliding-window layers (window 24: over several 16-token blocks), soft-capping, (1 + w) norms.
    "gemma2": dict(  # local, global; both soft-caps
        model_type="gemma2",
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=24,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=8.0,
        tie_word_embeddings=False,  # tied, the scaled embedding dominates: a tiny model repeats its input
    ),
    "gemma3": dict(  # q/k norms, local and global rope bases, linear scaling on the global one
        model_type="gemma3_text",
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,  # tied, the scaled embedding dominates: a tiny model repeats its input
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    # Fused qkv/gate_up tensors; LongRoPE (prompts stay under the original length, where HF's factors are
    # ours) with partial rotary, as Phi-4-mini: 3/4 of each head rotates.
    "phi3": dict(
        model_type="phi3",
        tie_word_embeddings=False,
        pad_token_id=0,
        partial_rotary_factor=0.75,
        max_position_embeddings=1024,
        original_max_position_embeddings=512,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
        },
    ),
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False, pad_token_id=0),  # post-norms, q/k norm
}


# Special tokens first, so their ids are TINY's: bos 1, eos 2.
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_CORPUS = [
    'The capital of France is Paris. {"name": "Ada", "age": 36, "tags": ["a", "b"], "ok": true}',
    "Hello world! red green blue, yes or no: 12345 + 678 = 13023. alice@example.com",
] * 10


def make_tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE tokenizer (every byte is a token, so any text encodes) with TINY's bos and eos,
    narrower than TINY's 512 logits: ids from `vocab_size` on exist only in the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=TINY_SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def make_tiny_model(folder: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """overrides: config fields on top of the family's (head_dim=32, say)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family]) | overrides
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **(TINY | spec))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation (argmax each step, never stopping at eos, never
    suppressing it): the reference our engine must equal token for token."""
    out, past, inputs = [], None, torch.tensor([prompt])
    for _ in range(max_new_tokens):
        result = model(inputs, past_key_values=past, use_cache=True)
        past = result.past_key_values
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        inputs = torch.tensor([[token]])
    return out


def random_prompts(n: int, min_len: int, max_len: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lengths]


def teacher_forced_top_tokens(llm: Any, sequences: list[list[int]]) -> list[int]:
    """The greedy next token at every position of each sequence after its first (teacher-forced: one
    differing token cannot snowball), all concatenated: for comparing weights' precisions position by
    position."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    return [
        max(entry.items(), key=lambda item: item[1].logprob)[0]
        for out in llm.generate(sequences, params, use_tqdm=False)
        for entry in (out.prompt_logprobs or [])[1:]
        if entry is not None
    ]
