"""Who sent a request, from what the client cannot mint: its tenant, its priority and its flow (fairness id).

Nothing a client writes in a header sets its own scheduling class. The sources, in order:

1. **A header set by a trusted ingress** (`TenantSettings.trusted_headers`, by role: ``tenant``, ``priority``,
   ``objective``, ``fairness``): read only for the roles the operator lists, because only the gateway in front
   (which must set or strip each) makes them trustworthy. prefixroute's own Envoy configuration strips a client's
   copies of all four at ingress and sets the fairness header itself, to the client connection's peer address
   (`FLOW_HEADER_VALUE`), so the default trusts ``fairness`` alone. Behind a Gateway API Inference Extension
   gateway whose policy injects the fairness id and the objective from the caller's identity, list those
   (``fairness,objective``): that gateway is the trusted ingress, as it is for GIE's own endpoint picker.
2. **The operator's tenant table** (`TenantSettings.tenants_file`, JSON, `TenantTable`): API keys, named by the
   SHA-256 of the client's ``authorization: Bearer`` key (the raw key is never stored, logged or compared: the
   file holds digests, the router hashes each request's key once), each to a tenant and optionally a priority;
   and tenants (however named: a key or a trusted tenant header) to their priority. A key the table does not
   list names nobody: anyone can invent keys, so an unknown key counts as no key.
3. **Nothing**: no tenant (the shared cache namespace), priority 0, and the flow the fairness header names (the
   client's address behind prefixroute's Envoy), else the one default flow.

So a client that rotates fairness ids, tenant names or API keys stays one flow (its address, or its tenant), and
a client that sends ``x-prefixroute-priority: 1000`` is priority 0. The GIE objective header maps to a priority
only through the operator's table (`FlowSettings.objective_priorities`) and only when ``objective`` is trusted.

Pure: no I/O but the table's file, read once at start (`TenantTable.load`). Resolving one request costs a few
dictionary lookups, plus one SHA-256 of its key when the table lists keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from prefixroute.extproc.headers import FAIRNESS_HEADER
from prefixroute.settings import Settings, setting

ROLES = ("tenant", "priority", "objective", "fairness")
"""What a trusted header may say about a request (`TenantSettings.trusted_headers`)."""
DEFAULT_FLOW = "default-flow"
"""A request no source names a flow for is of this one (GIE's name for it)."""
MAX_NAME_CHARS = 256
"""Longest tenant or flow name kept as written (longer ones are cut: a name is an operator's word, or an
address)."""
MAX_TABLE_ENTRIES = 100_000
"""Most API keys or tenants one table may list (a table is read whole at start and kept in memory)."""


@dataclasses.dataclass(frozen=True)
class TenantSettings(Settings):
    """Where a request's tenant, priority and flow come from (module docstring). Immutable; validated on
    construction (the table's file is read by `Tenants`)."""

    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_"
    TITLE: ClassVar[str] = "Tenants and priorities"

    tenants_file: str = setting(
        "",
        "The operator's tenant table, a JSON file: {\"api_keys\": {\"<sha256 hex of the API key>\": {\"tenant\": "
        "\"acme\", \"priority\": 10}}, \"tenants\": {\"acme\": {\"priority\": 10}}}. A request whose "
        "'authorization: Bearer KEY' digest is listed is that tenant (its flow, its cache namespace) at that "
        "priority (else the tenant's); a tenant named by a trusted tenant header takes its priority from "
        "\"tenants\". Keys absent from the table count as no key. Digest a key with: printf %s \"$KEY\" | "
        "sha256sum. Empty = no table: every request is priority 0 and its flow is the fairness header's (the "
        "client's address behind prefixroute's Envoy).")
    trusted_headers: tuple[str, ...] = setting(
        ("fairness",),
        "Roles whose request header the router believes, comma-separated: tenant (tenant_header), priority "
        "(priority_header), objective (objective_header, mapped by objective_priorities), fairness "
        "(fairness_header). Only for headers the gateway in front sets or strips: prefixroute's Envoy strips "
        "every client copy and sets the fairness header to the client's address, hence the default 'fairness'. "
        "Behind a Gateway API Inference Extension gateway that injects the fairness id and objective from the "
        "caller's identity: fairness,objective. Behind an ingress that authenticates callers and names their "
        "tenant: add tenant (and envoy-config --trusted-ingress-headers for prefixroute's Envoy).")

    def __post_init__(self) -> None:
        unknown = [r for r in self.trusted_headers if r not in ROLES]
        if unknown:
            raise ValueError(f"trusted_headers: unknown role(s) {', '.join(map(repr, unknown))}; expected any of "
                             f"{', '.join(ROLES)}")

    def trusts(self, role: str) -> bool:
        return role in self.trusted_headers


def key_digest(api_key: str) -> str:
    """The SHA-256 hex digest naming `api_key` in the tenant table (what ``printf %s KEY | sha256sum`` prints)."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``authorization: Bearer KEY`` header value; None for none or another scheme."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


@dataclasses.dataclass(frozen=True, slots=True)
class TableEntry:
    tenant: str
    priority: int | None = None


class TenantTable:
    """The operator's table (`TenantSettings.tenants_file`): key digest -> tenant (and priority), tenant ->
    priority. Immutable once built."""

    __slots__ = ("keys", "priorities")

    def __init__(self, keys: Mapping[str, TableEntry] | None = None,
                 priorities: Mapping[str, int] | None = None) -> None:
        self.keys: dict[str, TableEntry] = dict(keys or {})
        self.priorities: dict[str, int] = dict(priorities or {})

    @classmethod
    def from_mapping(cls, data: Any) -> TenantTable:
        """The table of a parsed JSON document (module docstring's shape). Raises ValueError naming what is wrong:
        a table that would silently grant nothing must not start."""
        if not isinstance(data, dict) or set(data) - {"api_keys", "tenants"}:
            raise ValueError('tenants_file: expected an object with "api_keys" and/or "tenants"')
        keys: dict[str, TableEntry] = {}
        raw_keys = data.get("api_keys") or {}
        raw_tenants = data.get("tenants") or {}
        if not isinstance(raw_keys, dict) or not isinstance(raw_tenants, dict):
            raise ValueError('tenants_file: "api_keys" and "tenants" must be objects')
        if len(raw_keys) > MAX_TABLE_ENTRIES or len(raw_tenants) > MAX_TABLE_ENTRIES:
            raise ValueError(f"tenants_file: at most {MAX_TABLE_ENTRIES} keys and tenants")
        for digest, entry in raw_keys.items():
            d = str(digest).lower()
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"tenants_file: api_keys are SHA-256 hex digests of the keys (64 hex digits), "
                                 f"got {str(digest)[:16]!r}...; never the keys themselves")
            if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str) or not entry["tenant"]:
                raise ValueError(f"tenants_file: api key {d[:12]}... needs a \"tenant\" name")
            keys[d] = TableEntry(entry["tenant"][:MAX_NAME_CHARS], _priority(entry, f"api key {d[:12]}..."))
        priorities: dict[str, int] = {}
        for name, entry in raw_tenants.items():
            if not isinstance(entry, dict):
                raise ValueError(f"tenants_file: tenant {name!r} must be an object")
            p = _priority(entry, f"tenant {name!r}")
            if p is not None:
                priorities[str(name)[:MAX_NAME_CHARS]] = p
        return cls(keys, priorities)

    @classmethod
    def load(cls, path: str | Path) -> TenantTable:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"tenants_file {path}: not JSON ({exc})") from None
        return cls.from_mapping(data)


def _priority(entry: dict, what: str) -> int | None:
    p = entry.get("priority")
    if p is None:
        return None
    if type(p) is not int:  # noqa: E721 - bool is an int subclass and no priority
        raise ValueError(f"tenants_file: {what}: priority must be an integer")
    return p


@dataclasses.dataclass(frozen=True, slots=True)
class Client:
    """A request's sender as the router trusts it: ``tenant`` (None: none; salts its hashes and sessions),
    ``priority`` (None: no trusted source set one) and ``flow`` (its fairness id: never None)."""

    tenant: str | None
    priority: int | None
    flow: str


class Tenants:
    """Resolves requests' `Client` (module docstring). `tenant_header`, `priority_header`, `objective_header`,
    `fairness_header`: the header of each role (RoutingSettings / FlowSettings names). One event loop (or any
    thread: it holds no mutable state)."""

    def __init__(self, settings: TenantSettings | None = None, *, tenant_header: str = "x-prefixroute-tenant",
                 priority_header: str = "x-prefixroute-priority",
                 objective_header: str = "x-gateway-inference-objective",
                 fairness_header: str = FAIRNESS_HEADER, table: TenantTable | None = None) -> None:
        self.settings = s = settings or TenantSettings()
        if table is None:
            table = TenantTable.load(s.tenants_file) if s.tenants_file else TenantTable()
        self.table = table
        self.tenant_header = tenant_header if s.trusts("tenant") else ""
        self.priority_header = priority_header if s.trusts("priority") else ""
        self.objective_header = objective_header if s.trusts("objective") else ""
        self.fairness_header = fairness_header if s.trusts("fairness") else ""
        self._routing_tenant_header = tenant_header

    def resolve(self, headers: Mapping[str, str]) -> Client:
        """`headers`' sender (lower-case names): its trusted tenant, priority and flow."""
        tenant: str | None = None
        priority: int | None = None
        table = self.table
        if self.tenant_header and (named := headers.get(self.tenant_header)):
            tenant = named.strip()[:MAX_NAME_CHARS] or None
        if tenant is None and table.keys:
            key = bearer_key(headers.get("authorization"))
            entry = table.keys.get(key_digest(key)) if key is not None else None
            if entry is not None:
                tenant, priority = entry.tenant, entry.priority
        if tenant is not None and priority is None:
            priority = table.priorities.get(tenant)
        if self.priority_header:
            given = _int(headers.get(self.priority_header))
            if given is not None:
                priority = given
        if tenant is not None:
            flow = "tenant:" + tenant
        else:
            named_flow = headers.get(self.fairness_header) if self.fairness_header else None
            flow = (named_flow.strip()[:MAX_NAME_CHARS] if named_flow else "") or DEFAULT_FLOW
        return Client(tenant, priority, flow)

    def objective(self, headers: Mapping[str, str]) -> str | None:
        """The trusted objective name (GIE), or None (not trusted, or absent)."""
        if not self.objective_header:
            return None
        name = headers.get(self.objective_header)
        return name.strip() if name else None

    def parse_headers(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """`headers` as the request parser must read them: the routing tenant header holding the trusted tenant
        (or absent), whatever the client sent. The same mapping when nothing changes (no copy: the common case,
        no tenant header and no table)."""
        name = self._routing_tenant_header
        if not name:
            return headers
        sent = headers.get(name)
        if sent is None and not self.table.keys:
            return headers
        tenant = self.resolve(headers).tenant
        if sent == tenant:
            return headers
        out = dict(headers)
        if tenant is None:
            out.pop(name, None)
        else:
            out[name] = tenant
        return out


def _int(raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None
