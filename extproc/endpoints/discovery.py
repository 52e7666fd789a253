"""Endpoint discovery from DNS: every A/AAAA record of a name is an endpoint (a Kubernetes headless Service).

``--endpoints-dns NAME:PORT`` (repeatable, comma-separated): each address NAME resolves to is one endpoint
``IP:PORT`` (``[v6]:PORT``). A headless Service (``clusterIP: None``) answers with one record per *ready* pod,
so the pool follows pods as they come, go, restart with new addresses or fail their readiness probe.

Why DNS and not the Kubernetes API (a watch of the pool's pods): it needs no service account, no RBAC and no
client library, it works the same for any DNS-published fleet (Consul, compose, a static zone), and CoreDNS
already turns pod readiness into records. The cost is the record TTL (5 s in CoreDNS's default) plus one
``resolve_interval_s``: a new pod is routed to within ~10 s; a pod that dies is out of routing within ~2 s
anyway, through the pool's health probes and the gateway's failure reports.

Contract of one lookup round (every ``resolve_interval_s``, with dnspython's asyncio resolver: never blocks
the event loop):

- A non-empty answer (A and AAAA together) *replaces* that name's set: records added are new endpoints (they
  start down and come up on their first successful probe), records removed leave the pool at once (their
  prefix-index entries and KV-event subscriptions go with them).
- A failed lookup (timeout, SERVFAIL, refused, no nameserver answering) keeps the name's last known set: a
  DNS outage must not empty a working fleet; health probes keep checking each endpoint on its own.
- An empty answer (NXDOMAIN, or no A/AAAA record) also keeps the last known set, and is logged. It is what a
  headless Service answers while none of its pods is ready (a rollout replacing every pod at once, a cluster
  DNS restart serving an incomplete zone); dropping the set would throw away every prefix index entry for a
  state that usually lasts seconds, while keeping it costs nothing: the pool's probes mark the gone pods
  down, so nothing is routed to them, and the next non-empty answer replaces them. The first non-empty
  answer after that is followed as usual, so scaling to zero and back up lands on the new pods.
- Before any non-empty answer a name contributes nothing (the router starts, reports 0 endpoints, and serves
  "no healthy endpoint" answers until the name resolves).

The membership handed to `on_change` is the static endpoints (``--endpoints``/``--endpoints-file``) followed by
every name's addresses in sorted order (deduplicated), so it is deterministic whatever order the DNS server
returns records in; `on_change` is called only when it differs from the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Callable, Iterable, Sequence

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from prefixroute.extproc.endpoints.scrape import parse_endpoint
from prefixroute.extproc.endpoints.settings import PoolSettings

log = logging.getLogger(__name__)

OnChange = Callable[[list[str]], None]


def parse_dns_name(spec: str) -> tuple[str, int]:
    """``NAME:PORT`` -> (NAME, PORT); ValueError with a clear message (an IP literal is no name to resolve)."""
    ep = parse_endpoint(spec)
    host, _, port = ep.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host, int(port)
    raise ValueError(f"--endpoints-dns {spec!r}: {host} is an address, not a name; list it in --endpoints")


def parse_nameserver(spec: str) -> tuple[str, int]:
    """``IP``, ``IP:PORT`` or ``[v6]:PORT`` -> (IP, PORT); port 53 by default. ValueError else."""
    s = spec.strip()
    host, port = s, "53"
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"nameserver {spec!r} is not IP[:PORT]")
            port = rest[1:]
    elif s.count(":") == 1:
        host, _, port = s.partition(":")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"nameserver {spec!r}: {host!r} is not an IP address") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"nameserver {spec!r}: port must be a number in 1-65535")
    return str(ip), int(port)


class LookupFailed(Exception):
    """The DNS servers did not answer (timeout, SERVFAIL, refused): the caller keeps what it knew."""


def make_resolver(nameservers: Sequence[str] = (), timeout_s: float = 2.0) -> dns.asyncresolver.Resolver:
    """An asyncio resolver: the system's configuration (/etc/resolv.conf: nameservers, search domains, ndots, as
    a pod has them) or, with `nameservers`, exactly those (``IP[:PORT]``). `timeout_s` bounds one lookup."""
    if nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port)
                                for ip, port in map(parse_nameserver, nameservers)]
    else:
        try:
            resolver = dns.asyncresolver.Resolver()
        except dns.exception.DNSException as exc:  # no /etc/resolv.conf, or one without a nameserver
            raise ValueError(f"--endpoints-dns: no system DNS configuration ({exc}); pass "
                             "--endpoints-dns-nameservers") from None
    resolver.lifetime = timeout_s
    resolver.timeout = timeout_s  # one try per server within the lifetime; the next round retries anyway
    resolver.cache = None  # every round asks: the record TTL (5 s on CoreDNS) already bounds staleness
    return resolver


async def lookup_addresses(resolver: dns.asyncresolver.Resolver, name: str) -> list[str]:
    """Every A and AAAA address of `name` (search domains applied, as ``getaddrinfo`` does), sorted, or [] when
    the name does not exist or has no such record. Raises `LookupFailed` when the servers do not answer."""

    async def one(rdtype: str) -> list[str]:
        try:
            answer = await resolver.resolve(name, rdtype, search=True, raise_on_no_answer=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.YXDOMAIN) as exc:
            raise LookupFailed(f"{name} {rdtype}: {exc.__class__.__name__}: {exc}") from None
        except dns.exception.DNSException as exc:
            raise LookupFailed(f"{name} {rdtype}: {exc.__class__.__name__}: {exc}") from None
        return [rr.address for rr in answer.rrset] if answer.rrset is not None else []

    v4, v6 = await asyncio.gather(one("A"), one("AAAA"))
    return sorted({str(ipaddress.ip_address(a)) for a in v4 + v6}, key=lambda a: ipaddress.ip_address(a).packed)


def _endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsDiscovery:
    """Follows the addresses of some names and reports the resulting membership (module docstring).

    Runs in the router's event loop; `refresh` is one round, `start` runs rounds every `interval_s`."""

    def __init__(self, names: Iterable[str], on_change: OnChange, *, static: Iterable[str] = (),
                 interval_s: float = 5.0, resolver: dns.asyncresolver.Resolver | None = None) -> None:
        self.names = [parse_dns_name(n) for n in names]
        self.static = [str(parse_endpoint(s)) for s in static]
        self.on_change = on_change
        self.interval_s = interval_s
        self.resolver = resolver or make_resolver()
        self.known: dict[tuple[str, int], list[str]] = {}  # name -> last non-empty answer (addresses)
        self.num_lookups = 0
        self.num_failures = 0  # lookups that failed (the last known set was kept)
        self.num_empty = 0  # empty answers (the last known set was kept)
        self._endpoints: list[str] | None = None  # last membership reported (None: never)
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> list[str]:
        """The membership now: static endpoints, then every name's known addresses."""
        out = list(self.static)
        for (_, port), ips in sorted(self.known.items()):
            out += [_endpoint(ip, port) for ip in ips]
        return list(dict.fromkeys(out))

    async def refresh(self) -> bool:
        """Look every name up once (concurrently); report the membership if it changed. Returns whether it did."""
        results = await asyncio.gather(*(lookup_addresses(self.resolver, host) for host, _ in self.names),
                                       return_exceptions=True)
        for key, res in zip(self.names, results, strict=True):
            self.num_lookups += 1
            name = f"{key[0]}:{key[1]}"
            if isinstance(res, LookupFailed):
                self.num_failures += 1
                log.warning("endpoints-dns %s: lookup failed (%s); keeping the last known %d endpoint(s)", name,
                            res, len(self.known.get(key, ())))
            elif isinstance(res, BaseException):
                raise res
            elif not res:
                self.num_empty += 1
                if self.known.get(key):
                    log.warning("endpoints-dns %s: empty answer; keeping the last known %d endpoint(s) until a "
                                "non-empty one", name, len(self.known[key]))
            else:
                if res != self.known.get(key):
                    log.info("endpoints-dns %s: %s", name, ", ".join(res))
                self.known[key] = res
        endpoints = self.endpoints
        if endpoints == self._endpoints:
            return False
        self._endpoints = endpoints
        self.on_change(endpoints)
        return True

    def start(self) -> None:
        """Run a round every `interval_s` in the background until `close` (call `refresh` once first to start
        with a membership)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="endpoints-dns")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - discovery must go on; the pool keeps its membership meanwhile
                log.exception("endpoints-dns round failed")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def discovery_from_settings(settings: PoolSettings, on_change: OnChange, *,
                            static: Iterable[str] = ()) -> DnsDiscovery | None:
    """The discovery ``--endpoints-dns`` asks for (None without names); ValueError for a malformed name or
    nameserver. `static`: the endpoints listed by ``--endpoints``/``--endpoints-file`` (kept first)."""
    if not settings.endpoints_dns:
        return None
    return DnsDiscovery(settings.endpoints_dns, on_change, static=static, interval_s=settings.resolve_interval_s,
                        resolver=make_resolver(settings.endpoints_dns_nameservers, settings.endpoints_dns_timeout_s))
