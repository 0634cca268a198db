"""scripts/check_commit_msg.py, the commit-msg hook: subjects of at most 72 characters, then a blank line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_commit_msg.py"
_spec = importlib.util.spec_from_file_location("check_commit_msg", SCRIPT)
assert _spec is not None and _spec.loader is not None
check_commit_msg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_commit_msg)


def test_a_72_character_subject_with_a_body_passes() -> None:
    assert check_commit_msg.problems("x" * 72 + "\n\nWhy, with the numbers.\n") == []


def test_a_73_character_subject_is_refused_with_its_length() -> None:
    (problem,) = check_commit_msg.problems("x" * 73 + "\n")
    assert "73 characters" in problem and "72" in problem


def test_the_body_must_follow_a_blank_line() -> None:
    (problem,) = check_commit_msg.problems("Add a thing\nwith details on the next line\n")
    assert "second line blank" in problem


def test_editor_comments_and_leading_blank_lines_are_not_the_subject() -> None:
    text = "\n# Please enter the commit message\n\nShort subject\n\n# " + "x" * 100 + "\n"
    assert check_commit_msg.problems(text) == []


def test_an_empty_message_is_refused() -> None:
    assert check_commit_msg.problems("# only comments\n\n") == ["the message is empty"]


def test_the_hook_exits_1_and_says_why(tmp_path: Path) -> None:
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text("y" * 80 + "\n")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(message)], capture_output=True, text=True)
    assert proc.returncode == 1 and "80 characters" in proc.stderr
    message.write_text("Fix it\n")
    assert subprocess.run([sys.executable, str(SCRIPT), str(message)]).returncode == 0
