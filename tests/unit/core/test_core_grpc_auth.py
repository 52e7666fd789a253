"""prefixroute.grpc_auth: the token and TLS rules shared by the ext_proc service and the OTLP receiver (the
refusal itself is tested through real servers: test_gateway_hardening_extproc_auth.py,
test_telemetry_receiver_security.py)."""

from __future__ import annotations

import pytest

from prefixroute.grpc_auth import bearer_matches, read_token, server_credentials


@pytest.mark.parametrize(("authorization", "ok"), [
    ("Bearer s3cret", True),
    ("bearer s3cret", True),  # the scheme is case-insensitive (RFC 6750)
    (b"Bearer s3cret", True),
    ("Bearer  s3cret ", True),
    ("Bearer s3cre", False),
    ("Bearer s3cret!", False),
    ("Basic s3cret", False),
    ("s3cret", False),
    ("Bearer", False),
    ("", False),
    (None, False),
])
def test_bearer_matches(authorization, ok):
    assert bearer_matches(authorization, b"s3cret") is ok


def test_read_token_inline_file_and_errors(tmp_path):
    f = tmp_path / "t"
    f.write_text("  from-file \n")
    assert read_token("", "") is None
    assert read_token(" inline ", "") == "inline"
    assert read_token("", str(f)) == "from-file"
    with pytest.raises(ValueError, match="not both"):
        read_token("inline", str(f))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token("", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="auth token file"):
        read_token("", str(tmp_path / "missing"))


def test_server_credentials_needs_cert_and_key(tmp_path):
    assert server_credentials("", "") is None
    with pytest.raises(ValueError, match="both"):
        server_credentials("cert.pem", "")
    with pytest.raises(ValueError, match="both"):
        server_credentials("", "", str(tmp_path / "ca.pem"))
    with pytest.raises(ValueError, match="TLS file"):
        server_credentials(str(tmp_path / "no-cert"), str(tmp_path / "no-key"))
