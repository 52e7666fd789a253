"""The state folder: where prefixroute keeps the request store and logs (never the current folder), and run ids."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from prefixroute.state import DB_NAME, default_db, ensure_dir, new_run_id, state_dir


@pytest.mark.parametrize(("env", "expected"), [
    ({"PREFIXROUTE_STATE_DIR": "/srv/pr", "XDG_STATE_HOME": "/x", "HOME": "/h"}, "/srv/pr"),
    ({"XDG_STATE_HOME": "/x/state", "HOME": "/h"}, "/x/state/prefixroute"),
    # The XDG specification: a relative XDG_STATE_HOME is invalid and ignored.
    ({"XDG_STATE_HOME": "rel/state", "HOME": "/h"}, "/h/.local/state/prefixroute"),
    ({"XDG_STATE_HOME": "", "HOME": "/h"}, "/h/.local/state/prefixroute"),
    ({"HOME": "/home/u"}, "/home/u/.local/state/prefixroute"),
])
def test_state_dir_precedence(env: dict[str, str], expected: str) -> None:
    assert state_dir(env) == Path(expected)
    assert default_db(env) == str(Path(expected) / DB_NAME)


def test_a_relative_explicit_state_dir_is_taken_from_the_current_folder(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert state_dir({"PREFIXROUTE_STATE_DIR": "st"}) == tmp_path / "st"


def test_ensure_dir_creates_every_missing_folder_owner_only(tmp_path: Path) -> None:
    (tmp_path / "existing").mkdir(mode=0o755)
    target = tmp_path / "existing" / "a" / "b"
    assert ensure_dir(target) == target
    for d in (tmp_path / "existing" / "a", target):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE((tmp_path / "existing").stat().st_mode) == 0o755  # an existing folder keeps its mode
    ensure_dir(target)  # idempotent


def test_run_ids_name_their_start_and_differ() -> None:
    a = new_run_id(now=1_800_000_000.0)
    assert re.fullmatch(r"20270115-080000-[0-9a-f]{4}", a), a
    assert new_run_id(now=1_800_000_001.0) > a  # sorted by start time
    assert len({new_run_id(now=1_800_000_000.0) for _ in range(50)}) > 40  # same second: still (nearly) unique
