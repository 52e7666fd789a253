"""Every registered command builds its parser (no flag clashes between the settings it combines)."""

from __future__ import annotations

import pytest

from prefixroute import cli


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_works(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert "usage: prefixroute" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "model-server" in capsys.readouterr().out
