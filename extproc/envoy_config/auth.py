"""How Envoy authenticates to the ext_proc service: a bearer token from an Envoy secret, injected on every
stream by a credential_injector upstream filter (never gRPC initial metadata: Envoy redacts secrets from
/config_dump), and TLS with the service's certificate and SAN verified (mutual TLS with a client certificate)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from envoy_data_plane.envoy.config.core.v3 import DataSource, TransportSocket, TypedExtensionConfig
from envoy_data_plane.envoy.extensions.filters.http.credential_injector.v3 import CredentialInjector
from envoy_data_plane.envoy.extensions.filters.http.upstream_codec.v3 import UpstreamCodec
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import HttpFilter
from envoy_data_plane.envoy.extensions.http.injected_credentials.generic.v3 import Generic as GenericCredential
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (CertificateValidationContext, CommonTlsContext,
                                                                        GenericSecret, SdsSecretConfig, Secret,
                                                                        SubjectAltNameMatcher,
                                                                        SubjectAltNameMatcherSanType, TlsCertificate,
                                                                        UpstreamTlsContext)
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.common import extproc_addresses
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings

EXTPROC_TOKEN_SECRET = "prefixroute_extproc_token"


def extproc_auth_token(s: EnvoySettings) -> str:
    """The bearer token Envoy sends to the ext_proc service: `extproc_auth_token`, else the stripped content of
    `extproc_auth_token_file`, else "" (none). OSError when the file cannot be read."""
    if s.extproc_auth_token:
        return s.extproc_auth_token
    if s.extproc_auth_token_file:
        return Path(s.extproc_auth_token_file).read_text().strip()
    return ""


def extproc_token_secret(s: EnvoySettings) -> Secret | None:
    """The ext_proc token as an Envoy secret: the file's path (Envoy reads it; the rendered configuration holds no
    token), else the inline token; None without one. Envoy strips nothing: a file's surrounding whitespace is
    refused here (a trailing newline would become part of the header)."""
    if s.extproc_auth_token:
        return Secret(name=EXTPROC_TOKEN_SECRET,
                      generic_secret=GenericSecret(secret=DataSource(inline_string=s.extproc_auth_token)))
    if s.extproc_auth_token_file:
        raw = Path(s.extproc_auth_token_file).read_bytes()
        if not raw.strip():
            raise ValueError(f"extproc_auth_token_file {s.extproc_auth_token_file} is empty")
        if raw != raw.strip():
            # Envoy would send the newline too: the stripped token goes inline (still a secret, redacted from
            # dumps, but in the rendered file: write the token file without a trailing newline to avoid that).
            return Secret(name=EXTPROC_TOKEN_SECRET, generic_secret=GenericSecret(
                secret=DataSource(inline_string=raw.strip().decode("utf-8", "replace"))))
        return Secret(name=EXTPROC_TOKEN_SECRET,
                      generic_secret=GenericSecret(secret=DataSource(filename=s.extproc_auth_token_file)))
    return None


def credential_filters(secret: str = EXTPROC_TOKEN_SECRET, header: str = "authorization") -> list[HttpFilter]:
    """Upstream filters of a router cluster: the token `secret` as ``<header>: Bearer ...`` on every stream or
    request (credential_injector), then the codec (which must come last). `header`: ``authorization`` on gRPC; the
    ext_authz HTTP checks use their own (authz_http.TOKEN_HEADER), since theirs carries the client's key."""
    return [
        HttpFilter(name="envoy.filters.http.credential_injector", typed_config=ProtoAny.pack(CredentialInjector(
            overwrite=True,
            credential=TypedExtensionConfig(name="envoy.http.injected_credentials.generic", typed_config=ProtoAny.pack(
                GenericCredential(credential=SdsSecretConfig(name=secret), header=header,
                                  header_value_prefix="Bearer ")))))),
        HttpFilter(name="envoy.filters.http.upstream_codec", typed_config=ProtoAny.pack(UpstreamCodec())),
    ]


def extproc_transport_socket(s: EnvoySettings, alpn: tuple[str, ...] = ("h2",)) -> TransportSocket | None:
    if not (s.extproc_tls_ca_file or s.extproc_tls_cert_file or s.extproc_tls_key_file):
        return None
    if not s.extproc_tls_ca_file:
        raise ValueError("extproc_tls_cert_file/extproc_tls_key_file need extproc_tls_ca_file (Envoy must verify "
                         "the ext_proc service's certificate)")
    if bool(s.extproc_tls_cert_file) != bool(s.extproc_tls_key_file):
        raise ValueError("extproc_tls_cert_file and extproc_tls_key_file go together")
    server_name = s.extproc_tls_server_name or extproc_addresses(s)[0].rpartition(":")[0]
    try:
        ipaddress.ip_address(server_name)
        san_type = SubjectAltNameMatcherSanType.IP_ADDRESS
    except ValueError:
        san_type = SubjectAltNameMatcherSanType.DNS
    common = CommonTlsContext(
        # gRPC servers negotiate HTTP/2 by ALPN (the ext_authz HTTP port: HTTP/1.1).
        alpn_protocols=list(alpn),
        tls_certificates=[TlsCertificate(certificate_chain=DataSource(filename=s.extproc_tls_cert_file),
                                         private_key=DataSource(filename=s.extproc_tls_key_file))]
        if s.extproc_tls_cert_file else [],
        # A CA alone checks the chain, not whose certificate it is: the SAN must name the service too.
        validation_context=CertificateValidationContext(
            trusted_ca=DataSource(filename=s.extproc_tls_ca_file),
            match_typed_subject_alt_names=[SubjectAltNameMatcher(
                san_type=san_type, matcher=StringMatcher(exact=server_name))]),
    )
    tls = UpstreamTlsContext(common_tls_context=common,
                             sni="" if san_type == SubjectAltNameMatcherSanType.IP_ADDRESS else server_name)
    return TransportSocket(name="envoy.transport_sockets.tls", typed_config=ProtoAny.pack(tls))
