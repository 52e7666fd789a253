"""What a user reads speaks to users: no issue numbers, "round N" or "finding N" (the project's own bookkeeping)
in the product package (help texts, report output, dashboard, code comments), the docs, the README, the scripts
and the deployment files."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
USER_FACING = ("common", "extproc", "model_servers", "telemetry", "dashboard", "bench", "stack", "docs", "scripts",
               "envoy", "deploy", "README.md", "docker-compose.yml", "Dockerfile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".toml", ".txt", ".lua", ".proto", ""}
BOOKKEEPING = re.compile(r"\bissues? ?#?\d+|\bissue-\d+|\bround \d+\b|\bfinding \d+\b|\bthe issue's\b", re.IGNORECASE)


def bookkeeping_words(root: Path) -> list[str]:
    """Every `path:line: text` under the user-facing paths of `root` that names an issue, round or finding."""
    found = []
    for top in USER_FACING:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in files:
            if path.suffix not in TEXT_SUFFIXES or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for num, line in enumerate(text.splitlines(), 1):
                if BOOKKEEPING.search(line):
                    found.append(f"{path.relative_to(root)}:{num}: {line.strip()[:120]}")
    return found


def test_no_issue_numbers_or_rounds_in_what_users_read():
    assert bookkeeping_words(REPO) == []


def test_the_check_finds_them(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("fine\nas issue 13's benchmark\nRound 1's policy\nissue #7\n")
    (tmp_path / "README.md").write_text("the issue's 4k\nround trip, 3 rounds, tissue 5\n")
    assert sorted(f.split(": ")[0] for f in bookkeeping_words(tmp_path)) == [
        "README.md:1", "docs/a.md:2", "docs/a.md:3", "docs/a.md:4"]
