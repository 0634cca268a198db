"""The commit-msg hook (.pre-commit-config.yaml): a subject of at most 72 characters, then a blank line
before the body, so that `git log --oneline` stays readable. docs/contributing.md has the rule.

    python scripts/check_commit_msg.py .git/COMMIT_EDITMSG
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72


def message_lines(text: str) -> list[str]:
    """The message as git keeps it: without the editor's comment lines and the blank lines before the subject."""
    lines = [line.rstrip() for line in text.splitlines() if not line.startswith("#")]
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def problems(text: str) -> list[str]:
    """What is wrong with a commit message, or [] when it is fine."""
    lines = message_lines(text)
    if not lines:
        return ["the message is empty"]
    found = []
    if len(lines[0]) > MAX_SUBJECT:
        found.append(
            f"the subject is {len(lines[0])} characters, at most {MAX_SUBJECT} allowed: "
            "keep it a short imperative line and put the details in the body"
        )
    if len(lines) > 1 and lines[1]:
        found.append("leave the second line blank: git joins the first paragraph into one subject")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_commit_msg.py COMMIT_MSG_FILE", file=sys.stderr)
        return 2
    found = problems(Path(argv[0]).read_text(encoding="utf-8"))
    for problem in found:
        print(f"commit message: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
