"""IncrementalDetokenizer against `tokenizer.decode` of the whole sequence, the reference.

No tokenizer can be downloaded here, so the tests train two small real ones: a GPT-2-style
byte-level BPE and a Llama-style BPE (Metaspace, leading-space stripping, byte fallback). A real
model's tokenizer (SmolLM2's): tests/e2e/test_detokenizer_e2e.py.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tokenmill.engine import detokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer, decoder_of

# No emoji or CJK here: the tokenizers learn no merges for them, so those split into byte tokens.
CORPUS = [
    "héllo wörld, the quick brown fox jumps over the lazy dog.",
    "Hello world! café naïve façade señor Grüße. Stop here, or STOP! later.",
    "def main():\n    return 42  # the answer\n",
] * 30


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Byte-fallback tokens <0x00>..<0xFF> live in the model's vocab, as in Llama's tokenizer.json.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The reference: `tokenizer.decode` of the whole sequence at once."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


def stream(
    tokenizer: PreTrainedTokenizerBase,
    output_ids: list[int],
    prompt_ids: list[int] | None = None,
    stop: list[str] | None = None,
    include_stop: bool = False,
    skip_special_tokens: bool = True,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feeds output_ids one token per step as the engine would; returns the deltas, final last."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids or [], skip_special_tokens, stop or [], include_stop)
    deltas = []
    for token_id in output_ids:
        if detok.update([token_id]) is not None:
            break
        deltas.append(detok.get_next_delta(final=False))
    deltas.append(detok.get_next_delta(final=True))
    return detok, deltas


def per_char_ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token (or one per byte) for each character, so strings span many tokens."""
    return [i for char in text for i in tokenizer.encode(char)]


TEXTS = ["héllo wörld 你好 🙂 done", "Hello world! 🙂🙂 ok", "你好, señor. Grüße 🚀\n  indented", "🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_deltas_concatenate_to_full_decode(byte_level: PreTrainedTokenizerFast, text: str) -> None:
    ids = byte_level.encode(text)
    detok, deltas = stream(byte_level, ids)
    assert "".join(deltas) == detok.output_text == decode(byte_level, ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_emoji_split_over_byte_tokens_is_held_until_complete(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("a🙂b")
    assert len(ids) == 6  # 'a', the emoji's 4 bytes F0 9F 99 82, 'b'
    _, deltas = stream(byte_level, ids)
    assert deltas == ["a", "", "", "", "🙂", "b", ""]


def test_random_byte_level_sequences_match_full_decode(byte_level: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    vocab_size = len(byte_level)
    for _ in range(150):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        detok, deltas = stream(byte_level, ids)
        full = decode(byte_level, ids)
        assert "".join(deltas) == detok.output_text == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in delta for delta in deltas)


def test_random_multibyte_text_split_at_every_byte_never_streams_broken_chars(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    rng = random.Random(1)
    chars = "aé你好🙂🚀 ,"
    for _ in range(50):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(1, 12)))
        ids = byte_level.encode(text)
        _, deltas = stream(byte_level, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_metaspace_keeps_spaces_that_per_token_decoding_drops(metaspace: PreTrainedTokenizerFast) -> None:
    text = "Hello world, the lazy dog.  Stop"
    ids = metaspace.encode(text)
    assert "".join(metaspace.batch_decode([[i] for i in ids])) != text  # why a window is needed
    detok, deltas = stream(metaspace, ids)
    assert "".join(deltas) == detok.output_text == decode(metaspace, ids) == text


def test_metaspace_first_output_token_keeps_leading_space_after_prompt(
    metaspace: PreTrainedTokenizerFast,
) -> None:
    prompt_ids = metaspace.encode("The quick brown")
    output_ids = metaspace.encode("The quick brown fox jumps")[len(prompt_ids) :]
    detok, deltas = stream(metaspace, output_ids, prompt_ids=prompt_ids)
    assert "".join(deltas) == detok.output_text == " fox jumps"
    assert decode(metaspace, prompt_ids) + detok.output_text == decode(metaspace, prompt_ids + output_ids)


def test_metaspace_byte_fallback_character_is_held_until_complete(metaspace: PreTrainedTokenizerFast) -> None:
    ids = metaspace.encode("Hello 你")
    assert metaspace.convert_ids_to_tokens(ids) == ["▁Hello", "▁", "<0xE4>", "<0xBD>", "<0xA0>"]
    _, deltas = stream(metaspace, ids)
    assert deltas == ["Hello", " ", "", "", "你", ""]


def test_prompt_ending_inside_a_character_is_not_used_as_context(byte_level: PreTrainedTokenizerFast) -> None:
    char_ids = byte_level.encode("你")  # 3 byte tokens
    prompt_ids, output_ids = byte_level.encode("say ") + char_ids[:2], char_ids[2:] + byte_level.encode("ok")
    detok, deltas = stream(byte_level, output_ids, prompt_ids=prompt_ids)
    assert "".join(deltas) == detok.output_text == decode(byte_level, output_ids) == "\ufffdok"


def test_random_metaspace_sequences_match_full_decode(metaspace: PreTrainedTokenizerFast) -> None:
    # Random vocab tokens mixed with whole characters in byte-fallback tokens. (ByteFallback turns a
    # whole run of byte tokens into '\ufffd's when any of it is invalid, which no window can mimic.)
    rng = random.Random(2)
    byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
    word_ids = sorted(i for token, i in metaspace.get_vocab().items() if token not in byte_tokens)

    def random_ids(max_pieces: int) -> list[int]:
        ids: list[int] = []
        for _ in range(rng.randint(0, max_pieces)):
            ids += metaspace.encode(rng.choice("é你好🙂🚀")) if rng.random() < 0.3 else [rng.choice(word_ids)]
        return ids

    for _ in range(150):
        prompt_ids, ids = random_ids(6), random_ids(20)
        detok, deltas = stream(metaspace, ids, prompt_ids=prompt_ids)
        assert "".join(deltas) == detok.output_text
        prompt_text = decode(metaspace, prompt_ids)
        assert prompt_text + detok.output_text == decode(metaspace, prompt_ids + ids)
        assert not any("\ufffd" in delta for delta in deltas)


def test_stop_string_is_cut_from_output(byte_level: PreTrainedTokenizerFast) -> None:
    detok, deltas = stream(byte_level, byte_level.encode("Hello world! Stop here"), stop=["world"])
    assert detok.stop_str == "world"
    assert "".join(deltas) == detok.output_text == "Hello "


def test_stop_string_is_kept_with_include_stop_str_in_output(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("Hello world! Stop here")
    detok, deltas = stream(byte_level, ids, stop=["world"], include_stop=True)
    assert "".join(deltas) == detok.output_text == "Hello world"


def test_stop_string_split_across_tokens_is_found(byte_level: PreTrainedTokenizerFast) -> None:
    ids = per_char_ids(byte_level, "the lazy dog STOP! more")
    detok = IncrementalDetokenizer(byte_level, [], True, ["STOP!"], False)
    results = [detok.update([i]) for i in ids[: len("the lazy dog STOP!")]]
    assert results[-1] == "STOP!" and results[:-1] == [None] * (len(results) - 1)
    assert detok.output_text == "the lazy dog "


def test_earliest_of_several_stop_strings_wins(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], True, ["dog", "lazy"], False)
    assert detok.update(byte_level.encode("the lazy dog")) == "lazy"
    assert detok.output_text == "the "


def test_streaming_never_leaks_a_partial_stop_string(byte_level: PreTrainedTokenizerFast) -> None:
    text = "ab STO and STOP! more"
    detok = IncrementalDetokenizer(byte_level, [], True, ["STOP!"], False)
    streamed = ""
    for token_id in per_char_ids(byte_level, text):
        if detok.update([token_id]) is not None:
            break
        streamed += detok.get_next_delta(final=False)
        assert "STOP!".startswith(detok.output_text[len(streamed) :])  # only a possible stop is held
    streamed += detok.get_next_delta(final=True)
    assert streamed == detok.output_text == "ab STO and "


def test_held_back_stop_prefix_is_released_at_finish(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], True, ["STOP!"], False)
    assert detok.update(per_char_ids(byte_level, "ab ST")) is None
    assert detok.get_next_delta(final=False) == "ab "
    assert detok.get_next_delta(final=True) == "ST"


def test_multi_token_update_gives_the_same_text(byte_level: PreTrainedTokenizerFast) -> None:
    ids = byte_level.encode("héllo 你好 🙂 the lazy dog STOP! more")
    detok = IncrementalDetokenizer(byte_level, [], True, ["STOP!"], False)
    assert detok.update(ids[:7]) is None
    assert detok.update(ids[7:]) == "STOP!"
    assert detok.get_next_delta(final=True) == detok.output_text == "héllo 你好 🙂 the lazy dog "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_matches_decode(byte_level: PreTrainedTokenizerFast, skip: bool) -> None:
    ids = byte_level.encode("Hello") + [byte_level.eos_token_id] + byte_level.encode(" world 🙂")
    detok, deltas = stream(byte_level, ids, skip_special_tokens=skip)
    expected = "Hello<|endoftext|> world 🙂" if not skip else "Hello world 🙂"
    assert "".join(deltas) == detok.output_text == decode(byte_level, ids, skip) == expected


def test_invalid_bytes_are_released_with_bounded_windows(
    byte_level: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    lone_continuation_byte = byte_level.convert_tokens_to_ids("Ģ")  # byte 0x80 in GPT-2's byte alphabet
    ids = [lone_continuation_byte] * 50 + byte_level.encode("ok") * 50
    window_lengths: list[int] = []
    original_decode = decoder_of(byte_level)

    def recording_decode(token_ids: list[int], skip: bool) -> str:
        window_lengths.append(len(token_ids))
        return original_decode(token_ids, skip)

    expected = decode(byte_level, ids)
    assert expected == "\ufffd" * 50 + "ok" * 50
    monkeypatch.setattr(detokenizer, "decoder_of", lambda _: recording_decode)
    detok, deltas = stream(byte_level, ids)
    assert "".join(deltas) == detok.output_text == expected
    assert max(window_lengths) <= 16


def test_update_after_stop_is_an_error(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, [], True, ["dog"], False)
    assert detok.update(byte_level.encode("the lazy dog")) == "dog"
    with pytest.raises(RuntimeError, match="after stop string"):
        detok.update(byte_level.encode(" more"))


def test_empty_stop_string_is_rejected(byte_level: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(byte_level, [], True, ["", "x"], False)


@pytest.mark.parametrize("skip", [True, False])
def test_the_direct_decoder_equals_the_tokenizers_decode(
    byte_level: PreTrainedTokenizerFast, metaspace: PreTrainedTokenizerFast, skip: bool
) -> None:
    rng = random.Random(5)
    for tokenizer in (byte_level, metaspace):
        decode = decoder_of(tokenizer)
        for _ in range(50):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
            assert decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode() -> None:
    wordpiece = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, ",": 2}, unk_token="[UNK]")),
        clean_up_tokenization_spaces=True,
    )
    wordpiece.backend_tokenizer.decoder = decoders.WordPiece(cleanup=False)
    # The clean-up removes the space before the comma; the Rust decode alone keeps it.
    assert wordpiece.decode([1, 2]) == "a," != wordpiece.backend_tokenizer.decode([1, 2])
    assert decoder_of(wordpiece)([1, 2], False) == "a,"
