"""Endpoint identity: a per-run secret proves that the process on an endpoint's port is the model server the
launcher started there (after a model server crashed, another local user bound its port 0.48 s later
and the router sent it requests, prompts included, because it passed the health probe).

Challenge and response, so the secret never travels: the router's health probe sends a fresh random
`CHALLENGE_HEADER`; a model server started with the key (`prefixroute model-server`, environment variable
`KEY_ENV`) answers with `PROOF_HEADER` = hex HMAC-SHA256(key, challenge). A process without the key cannot
answer, and a recorded answer is useless for the next challenge. The router (``--endpoint-identity-key-file``
or `KEY_ENV`) marks an endpoint whose answer does not verify down at once and says so in its log.

`prefixroute up` draws a key per run and gives it to its simulated servers and its router. Real vLLM or SGLang
servers have no such check: leave the key unset for them (then nothing is checked), and rely on what they offer
(``--api-key``) and on the hosts' own port discipline.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

CHALLENGE_HEADER = "x-prefixroute-challenge"
PROOF_HEADER = "x-prefixroute-proof"
KEY_ENV = "PREFIXROUTE_ENDPOINT_IDENTITY_KEY"
MAX_CHALLENGE_CHARS = 128


def new_key() -> str:
    return secrets.token_urlsafe(32)


def new_challenge() -> str:
    return secrets.token_hex(16)


def proof(key: str, challenge: str) -> str:
    """The answer to `challenge` under `key` (hex)."""
    return hmac.new(key.encode(), challenge.encode("latin-1", "replace"), hashlib.sha256).hexdigest()


def verify(key: str, challenge: str, answer: str | None) -> bool:
    """Whether `answer` is `proof(key, challenge)` (constant-time)."""
    return answer is not None and hmac.compare_digest(answer.encode("latin-1", "replace"),
                                                      proof(key, challenge).encode())


def resolve_key(key_file: str = "") -> str:
    """The identity key: $PREFIXROUTE_ENDPOINT_IDENTITY_KEY, else `key_file`'s content (stripped), else "" (no
    check). ValueError for an unreadable or empty file."""
    value = os.environ.get(KEY_ENV, "").strip()
    if value or not key_file:
        return value
    try:
        text = Path(key_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"endpoint identity key file: {exc}") from None
    if not text:
        raise ValueError(f"endpoint identity key file {key_file} is empty")
    return text


def http_proves(base_url: str, key: str, timeout_s: float = 0.5) -> bool:
    """Whether ``GET base_url/health`` answers 200 and, with `key`, proves the server's identity (a launcher's
    readiness check: an impostor on the port must not pass for the server it started)."""
    import urllib.error
    import urllib.request

    challenge = new_challenge()
    req = urllib.request.Request(base_url + "/health", headers={CHALLENGE_HEADER: challenge} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the launcher's own child
            return resp.status == 200 and (not key or verify(key, challenge, resp.headers.get(PROOF_HEADER)))
    except (OSError, ValueError, urllib.error.HTTPError):
        return False
