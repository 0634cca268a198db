"""The `copy-edit` benchmark workload: chat requests whose answers copy most of their prompt, built from
texts that ship inside the package, the same for a seed every run. Sizes with the embedded model's
tokenizer: tests/e2e/test_copy_edit_e2e.py."""

from __future__ import annotations

import ast
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tiny_models import make_tiny_tokenizer
from tokenmill.bench import make_workload
from tokenmill.bench.copy_edit import (
    KINDS,
    MAX_TYPOS,
    MIN_TYPOS,
    ChatTask,
    copy_edit_tasks,
    inject_typos,
    load_sources,
    renamable_names,
    rename,
)
from tokenmill.bench.datasets import COPY_EDIT_MAX_OUTPUT, TOKEN_WORKLOADS, chat_prompt_ids

VOCAB = 49_152
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The tests' byte-level tokenizer, without a chat template."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer() -> Any:
    tok = make_tiny_tokenizer()
    tok.chat_template = CHATML
    return tok


def lookup_share(prompt: list[int], answer: list[int], context: int = 2) -> float:
    """Share of the answer's tokens that prompt lookup could propose: the `context` tokens before it,
    followed by it, occur somewhere in the prompt."""
    grams = {tuple(prompt[i : i + context + 1]) for i in range(len(prompt) - context)}
    hits = [tuple(answer[i - context : i + 1]) in grams for i in range(context, len(answer))]
    return sum(hits) / len(hits)


# ---------------------------------------------------------------------- the texts
def test_the_texts_ship_inside_the_package() -> None:
    # importlib.resources reads what an installed wheel holds; pyproject's package data must list the file.
    assert resources.files("tokenmill.bench").joinpath("data/copy_edit.txt").is_file()
    if sys.version_info >= (3, 11):
        import tomllib

        pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
        assert "bench/data/*.txt" in pyproject["tool"]["setuptools"]["package-data"]["tokenmill"]


def test_every_kind_of_text_is_there_and_every_piece_of_code_parses() -> None:
    sources = load_sources()
    assert len(sources.prose) >= 8 and len(sources.code) >= 8 and len(sources.lists) >= 5
    for code in sources.code:
        ast.parse(code)
        assert renamable_names(code), "each piece of code needs a variable to rename"


# ---------------------------------------------------------------------- the tasks
def test_the_same_seed_gives_the_same_tasks_and_another_seed_others() -> None:
    assert copy_edit_tasks(np.random.default_rng(3), 16) == copy_edit_tasks(np.random.default_rng(3), 16)
    assert copy_edit_tasks(np.random.default_rng(3), 16) != copy_edit_tasks(np.random.default_rng(4), 16)


def test_the_kinds_come_in_turn() -> None:
    tasks = copy_edit_tasks(np.random.default_rng(0), 8)
    assert [t.kind for t in tasks] == list(KINDS) * 2


def test_a_workloads_worth_of_prompts_are_all_different() -> None:
    # Texts are dealt without repeats until all are used: no request is a whole-prompt prefix-cache hit.
    tasks = copy_edit_tasks(np.random.default_rng(0), 16)
    assert len({t.prompt for t in tasks}) == 16


def test_the_answer_of_a_repeat_is_the_text_in_the_prompt() -> None:
    for task in _of_kind("repeat"):
        assert task.prompt.endswith(task.answer)


def test_typos_change_a_few_words_and_nothing_else() -> None:
    text = load_sources().prose[0]
    for seed in range(20):
        typed = inject_typos(np.random.default_rng(seed), text)
        changed = [(a, b) for a, b in zip(text.split(" "), typed.split(" ")) if a != b]
        assert MIN_TYPOS <= len(changed) <= MAX_TYPOS
        assert all(abs(len(a) - len(b)) <= 1 for a, b in changed)  # one letter swapped, dropped or doubled


def test_a_typo_task_answers_with_the_text_before_the_typos() -> None:
    sources = load_sources()
    for task in _of_kind("typos"):
        assert task.answer in sources.prose and task.answer not in task.prompt


def test_a_rename_changes_the_variable_everywhere_and_nothing_else() -> None:
    code = load_sources().code[0]  # moving_average
    renamed = rename(code, "running_sum", "total")
    assert not re.search(r"\brunning_sum\b", renamed)
    assert renamed.count("total") == code.count("running_sum")
    assert rename(renamed, "total", "running_sum") == code
    ast.parse(renamed)


def test_a_rename_leaves_attributes_and_strings_alone() -> None:
    assert rename("x.count = count + 1", "count", "n") == "x.count = n + 1"
    assert "quantities" not in renamable_names("self.quantities = {}")
    assert "key" not in renamable_names('key = 1\nd = {"key": key}')
    assert "key" not in renamable_names("key = len\nsorted(a, key=key)")


def test_a_rename_task_names_both_variables_and_answers_with_the_renamed_code() -> None:
    for task in _of_kind("rename"):
        old, new = re.findall(r"`(\w+)`", task.prompt)[:2]
        assert re.search(rf"\b{old}\b", task.prompt) and not re.search(rf"\b{old}\b", task.answer)
        assert re.search(rf"\b{new}\b", task.answer)


def _of_kind(kind: str) -> list[ChatTask]:
    tasks = [t for seed in range(4) for t in copy_edit_tasks(np.random.default_rng(seed), 16) if t.kind == kind]
    assert tasks
    return tasks


# ---------------------------------------------------------------------- as requests
def test_answers_copy_most_of_their_prompt(chat_tokenizer: Any) -> None:
    # What n-gram speculation lives on: most answer tokens follow two tokens that occur in the prompt.
    for seed in range(3):
        for task in copy_edit_tasks(np.random.default_rng(seed), 16):
            prompt = chat_prompt_ids(chat_tokenizer, task.prompt)
            answer = chat_tokenizer.encode(task.answer, add_special_tokens=False)
            assert lookup_share(prompt, answer) >= 0.6, (task.kind, task.prompt[:80])


def test_requests_go_through_the_chat_template(chat_tokenizer: Any) -> None:
    request = make_workload("copy-edit", VOCAB, num_requests=1, tokenizer=chat_tokenizer)[0]
    text = chat_tokenizer.decode(request.prompt_token_ids)
    assert text.startswith("<|im_start|>user\nRepeat the following") and text.endswith("<|im_start|>assistant\n")


def test_a_tokenizer_without_a_template_gets_a_plain_transcript(tokenizer: Any) -> None:
    text = tokenizer.decode(chat_prompt_ids(tokenizer, "Repeat: hello"))
    assert text.endswith("User: Repeat: hello\n\nAssistant:")


def test_requests_are_greedy_stop_at_end_of_turn_and_leave_room_for_the_answer(chat_tokenizer: Any) -> None:
    tasks = copy_edit_tasks(np.random.default_rng(0), 16)
    requests = make_workload("copy-edit", VOCAB, tokenizer=chat_tokenizer)
    assert len(requests) == 16
    for task, request in zip(tasks, requests):
        params = request.sampling_params()
        assert params.temperature == 0.0 and not params.ignore_eos and params.max_tokens == request.output_len
        answer_len = len(chat_tokenizer.encode(task.answer, add_special_tokens=False))
        assert request.output_len == min(answer_len + 16, COPY_EDIT_MAX_OUTPUT)


def test_the_workload_is_the_same_for_a_seed(chat_tokenizer: Any) -> None:
    first = make_workload("copy-edit", VOCAB, seed=5, tokenizer=chat_tokenizer)
    assert first == make_workload("copy-edit", VOCAB, seed=5, tokenizer=chat_tokenizer)
    assert first != make_workload("copy-edit", VOCAB, seed=6, tokenizer=chat_tokenizer)


def test_without_a_tokenizer_the_workload_says_it_needs_one() -> None:
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        make_workload("copy-edit", VOCAB)


def test_tools_that_send_raw_token_ids_do_not_offer_it() -> None:
    assert "copy-edit" not in TOKEN_WORKLOADS and "random-cpu" in TOKEN_WORKLOADS
