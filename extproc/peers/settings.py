"""`PeerSettings`: how one replica (a ``prefixroute extproc`` process) shares its routing state with the others
behind the same Envoy, through NATS (extproc/peers/bus.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import ClassVar

from prefixroute.settings import Settings, setting

_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def default_replica_id() -> str:
    """``hostname-pid`` with every character a NATS subject token cannot hold (dots, spaces, wildcards) as
    ``-``: unique per process on a host, and per pod in Kubernetes (the pod name is the hostname)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{socket.gethostname()}-{os.getpid()}")


@dataclasses.dataclass(frozen=True)
class PeerSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_PEERS_"
    TITLE: ClassVar[str] = "Replicas sharing state (NATS)"

    url: str = setting("", "NATS server(s) the replicas share their picks through (`nats://host:4222`, several "
                       "comma-separated for a cluster). Empty = this replica routes alone (its own picks only) and "
                       "no connection is made.", flag="--peers-url")
    replica_id: str = setting("", "This replica's name on the bus (letters, digits, `-`, `_`); its own messages "
                              "are ignored by it. Empty = hostname-pid (unique per process and per pod).",
                              flag="--replica-id")
    subject_prefix: str = setting("prefixroute", "First token(s) of the NATS subjects (`PREFIX.routing.REPLICA`): "
                                  "two gateways sharing one NATS cluster use different prefixes.",
                                  flag="--peers-subject-prefix")
    pending_ttl_s: float = setting(30.0, "A peer's pick still prefilling (no first token nor end reported) is "
                                   "dropped from this replica's queues after this long: what is left of a peer "
                                   "that died or of a lost message. 30 s is well above a real time to first "
                                   "token (a queued 128k-token prefill takes seconds), so a live pick is never "
                                   "dropped early, and a dead replica's phantom queue lasts at most that long.",
                                   flag="--peers-pending-ttl-s")
    in_flight_ttl_s: float = setting(660.0, "A peer's request counted in flight here without its end reported "
                                     "is dropped after this long (a lost message): Envoy's whole-response "
                                     "timeout (upstream_timeout_s, 600 s) plus a minute, so no live request "
                                     "is dropped.", flag="--peers-in-flight-ttl-s")
    peer_timeout_s: float = setting(5.0, "A peer not heard from for this long (each sends at least a heartbeat "
                                    "a second) is gone: its requests in flight and pending here are dropped at "
                                    "once. 5 missed heartbeats: no false alarm on a busy loop, a dead replica's "
                                    "load forgotten within seconds.", flag="--peers-timeout-s")
    max_buffered_messages: int = setting(8192, "Messages waiting for the sender (one event-loop tick's worth "
                                         "normally, a few); beyond, new ones are dropped and counted (the bus is "
                                         "not keeping up). 8192 is seconds of picks at any real request rate.",
                                         flag="--peers-max-buffered-messages")
    max_batch_messages: int = setting(256, "Most messages in one NATS message (a batch per event-loop tick): "
                                      "256 picks of 64 block hashes are ~150 KB, under NATS's default 1 MB "
                                      "max_payload.", flag="--peers-max-batch-messages")
    linger_ms: float = setting(2.0, "How long the sender waits after a message before it sends, so that the "
                               "messages of several requests share one NATS message: each NATS message costs "
                               "every replica ~50-100 us of Python (nats-py's parser, a task wake-up, HMAC, "
                               "decode) whatever it carries, so one per request or less is what lets replicas "
                               "add throughput. 2 ms is under a tenth of a cached request's time to first token "
                               "and far under the TTLs (the peers see a pick 2 ms later: two replicas may send "
                               "the same cold prefix to the same idle endpoint in that window, as they may "
                               "in the network's own delay). 0: send at the end of the event-loop tick.",
                               flag="--peers-linger-ms")
    reconnect_wait_s: float = setting(0.5, "Wait between attempts to (re)connect to NATS, forever (the replica "
                                      "routes alone meanwhile): a restarted local nats-server is back in well "
                                      "under a second.", flag="--peers-reconnect-wait-s")
    max_in_flight_per_peer: int = setting(4096, "Another replica's requests this replica counts in flight at most "
                                          "(its picks beyond, until some end, are ignored): a replica routes that "
                                          "many at once only far past saturation, so a replica (or anything "
                                          "holding the bus key) sending picks without their ends cannot make an "
                                          "endpoint look busier than a real replica's load could.",
                                          flag="--peers-max-in-flight-per-peer")
    token_file: str = setting("", "File holding the NATS server's auth token (the env var PREFIXROUTE_PEERS_TOKEN "
                              "works too; never a flag: argv is world-readable). With a token, a server that does "
                              "not require authentication is refused before anything is sent to it (an impostor "
                              "on the NATS port gets neither the token nor a message).",
                              flag="--peers-token-file")
    key_file: str = setting("", "File holding the bus key (or env PREFIXROUTE_PEERS_KEY; at least 16 bytes): every "
                            "message is signed with HMAC-SHA256 under it and one that does not verify is dropped, "
                            "so only replicas holding the key can move this replica's state, whoever can reach "
                            "NATS. Empty: unsigned (only safe when NATS itself admits only the replicas). "
                            "`prefixroute gateway` draws one per run.", flag="--peers-key-file")
    tls_ca_file: str = setting("", "PEM CA bundle that signs the NATS server's certificate: set = connect with TLS "
                               "and verify the server (Kubernetes: the NATS manifest's TLS secret).",
                               flag="--peers-tls-ca-file")

    def __post_init__(self) -> None:
        if self.replica_id and not _TOKEN.fullmatch(self.replica_id):
            raise ValueError(f"--replica-id {self.replica_id!r}: only letters, digits, '-' and '_'")
        if not all(_TOKEN.fullmatch(t) for t in self.subject_prefix.split(".")):
            raise ValueError(f"--peers-subject-prefix {self.subject_prefix!r}: dot-separated tokens of letters, "
                             "digits, '-' and '_'")
        if not self.pending_ttl_s > 0 or self.max_buffered_messages < 1 or self.max_batch_messages < 1 or \
                not self.reconnect_wait_s > 0 or not 0 <= self.linger_ms <= 1000 or \
                not self.in_flight_ttl_s > 0 or not self.peer_timeout_s > 0 or self.max_in_flight_per_peer < 1:
            raise ValueError("--peers-linger-ms in [0, 1000], --peers-pending-ttl-s, --peers-reconnect-wait-s, "
                             "--peers-in-flight-ttl-s, --peers-timeout-s > 0, --peers-max-buffered-messages and "
                             "--peers-max-batch-messages >= 1")

    def resolved_replica_id(self) -> str:
        return self.replica_id or default_replica_id()

    def resolved_token(self) -> str:
        """The NATS auth token: $PREFIXROUTE_PEERS_TOKEN, else `token_file`'s content (stripped), else "".
        ValueError for an unreadable or empty file."""
        return _secret(os.environ.get("PREFIXROUTE_PEERS_TOKEN", ""), self.token_file, "--peers-token-file")

    def resolved_key(self) -> bytes:
        """The bus key: $PREFIXROUTE_PEERS_KEY, else `key_file`'s content (stripped), else b"" (unsigned).
        ValueError for an unreadable or empty file, or a key under 16 bytes."""
        key = _secret(os.environ.get("PREFIXROUTE_PEERS_KEY", ""), self.key_file, "--peers-key-file")
        if key and len(key) < 16:
            raise ValueError("the peers bus key must be at least 16 bytes")
        return key.encode()


def _secret(value: str, path: str, flag: str) -> str:
    if value.strip():
        return value.strip()
    if not path:
        return ""
    try:
        text = open(path, encoding="utf-8").read().strip()  # noqa: SIM115, PTH123
    except OSError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not text:
        raise ValueError(f"{flag}: {path} is empty")
    return text
