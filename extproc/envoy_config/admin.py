"""Envoy's admin interface (`admin_mode`: loopback read-only paths, a Unix socket, or none)."""

from __future__ import annotations

import re

from envoy_data_plane.envoy.config.bootstrap.v3 import Admin
from envoy_data_plane.envoy.config.core.v3 import Address, Pipe
from envoy_data_plane.envoy.type.matcher.v3 import RegexMatcher, StringMatcher

from prefixroute.extproc.envoy_config.common import address
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings

ADMIN_READ_ONLY_PATHS = ("/ready", "/stats", "/stats/prometheus", "/stats/recentlookups", "/server_info",
                         "/clusters", "/listeners", "/certs", "/memory", "/hot_restart_version", "/runtime", "/help")
"""The admin paths `admin_mode` loopback serves: what monitoring reads. Left out: /config_dump (configuration and
secrets' metadata), /logging (a POST raises the level: debug logs print clients' headers), /quitquitquit,
/drain_listeners, /healthcheck/fail and /healthcheck/ok, /runtime_modify, /reset_counters, /heapprofiler,
/cpuprofiler, /tap, /init_dump, /contention and anything added later (a path must be listed to be served)."""


def admin(s: EnvoySettings) -> Admin | None:
    """The admin interface `admin_mode` asks for (None: off); ValueError for an unknown mode or a missing socket."""
    if s.admin_mode == "off":
        return None
    if s.admin_mode == "unix":
        if not s.admin_socket_path:
            raise ValueError("admin_mode unix needs admin_socket_path")
        return Admin(address=Address(pipe=Pipe(path=s.admin_socket_path, mode=0o600)))
    if s.admin_mode == "loopback":
        # Envoy matches allow_paths against the path with its query string: each path, then any query.
        paths = "|".join(re.escape(p) for p in ADMIN_READ_ONLY_PATHS)
        return Admin(address=address(f"127.0.0.1:{s.admin_port}"),
                     allow_paths=[StringMatcher(safe_regex=RegexMatcher(regex=f"^({paths})(\\?[^#]*)?$"))])
    raise ValueError(f"admin_mode must be loopback, unix or off, got {s.admin_mode!r}")
