"""KV blocks in use for one long prompt on a Gemma-shaped model, with the window rule (a sliding-window
layer group frees the blocks behind its window: tokenmill/scheduling/window_group.py) and without it (every
layer keeps every block, as group 0 does). A count, not a timing.

The engine runs a small model with Gemma 2 2B's attention layout (26 layers alternating local and global,
window 4096, block 16) and dummy weights: the block counts depend only on the layout, the window, the block
size and the scheduling; the bytes are then those of the real model (8 query / 4 KV heads of 256, bf16 cache).

Usage: .venv/bin/python bench/scripts/window_blocks.py [--prompt 8192] [--out bench/results/xeon-amx/window_blocks.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import Gemma2Config

from tokenmill import LLM, SamplingParams

LAYERS, WINDOW, BLOCK = 26, 4096, 16
# Gemma 2 2B: one token's K and V in one layer, bf16: 2 x 4 KV heads x 256 x 2 bytes.
REAL_BYTES_PER_TOKEN_LAYER = 2 * 4 * 256 * 2


def small_gemma(folder: Path, max_len: int) -> Path:
    Gemma2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        max_position_embeddings=max_len,
    ).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=4, help="tokens generated after it")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    folder = small_gemma(Path(tempfile.mkdtemp()), args.prompt + args.decode + 16)
    llm = LLM(
        str(folder),
        load_format="dummy",
        dtype="float32",
        num_kv_blocks=-(-(args.prompt + args.decode) // BLOCK) + 8,
        block_size=BLOCK,
        max_num_batched_tokens=args.chunk,
    )
    kv = llm.engine.kv_cache
    window = kv.window_groups[0]
    steps: list[dict[str, int]] = []
    allocate = kv.allocate_slots

    def counted(request: Any, *a: Any, **kw: Any) -> list[int] | None:
        ids = allocate(request, *a, **kw)
        steps.append(
            {
                "computed_before_step": request.num_computed_tokens,
                "full_group_blocks": len(kv.req_blocks.get(request.req_id, [])),
                "window_group_blocks": window.num_held_blocks(request.req_id),
            }
        )
        return ids

    kv.allocate_slots = counted  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [3 + i % 500 for i in range(args.prompt)]}], params, use_tqdm=False)

    local = sum(1 for i in range(LAYERS) if (i + 1) % 2)  # Gemma 2: even layers (0, 2, ...) are local
    last = steps[-1]
    peak_window = max(s["window_group_blocks"] for s in steps)

    def layer_blocks(full: int, windowed: int) -> int:
        return (LAYERS - local) * full + local * windowed

    block_bytes = BLOCK * REAL_BYTES_PER_TOKEN_LAYER
    with_rule = layer_blocks(last["full_group_blocks"], last["window_group_blocks"])
    without = layer_blocks(last["full_group_blocks"], last["full_group_blocks"])
    result = {
        "model": f"Gemma 2 2B attention layout: {LAYERS} layers ({local} local, window {WINDOW}), block {BLOCK}",
        "prompt_tokens": args.prompt,
        "decoded_tokens": args.decode,
        "max_num_batched_tokens": args.chunk,
        "per_step": steps,
        "decoding": {
            "full_group_blocks": last["full_group_blocks"],
            "window_group_blocks": last["window_group_blocks"],
            "window_group_blocks_peak_during_prefill": peak_window,
            "layer_blocks_with_window_rule": with_rule,
            "layer_blocks_without_window_rule": without,
            "kv_mib_with_window_rule": with_rule * block_bytes / 2**20,
            "kv_mib_without_window_rule": without * block_bytes / 2**20,
        },
    }
    text = json.dumps(result, indent=1)
    print(json.dumps(result["decoding"], indent=1))
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
