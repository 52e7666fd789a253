"""One running stack per state folder: a second `prefixroute up` on a folder another live stack holds is refused,
naming the holder and --state-dir; the claim ends with its holder."""

from __future__ import annotations

import os

import pytest

from prefixroute.state import LOCK_NAME, StateInUse, claim_state


def test_a_second_claim_on_a_held_folder_is_refused_naming_the_holder_and_state_dir(tmp_path):
    folder = tmp_path / "state"
    fd = claim_state(folder, "pid 1234, run r1, API on port 8080")
    try:
        with pytest.raises(StateInUse) as err:
            claim_state(folder, "pid 5678")
        msg = str(err.value)
        assert "pid 1234, run r1, API on port 8080" in msg and "--state-dir" in msg and str(folder) in msg
        assert oct((folder).stat().st_mode & 0o777) == "0o700"
        other = claim_state(tmp_path / "other", "pid 5678")  # another folder: no conflict
        os.close(other)
    finally:
        os.close(fd)
    os.close(claim_state(folder, "pid 5678"))  # released: the next stack may take it
    assert (folder / LOCK_NAME).read_text() == "pid 5678"

