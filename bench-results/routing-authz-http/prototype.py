"""The prototype behind routing_filter ext_authz_http: one Envoy 1.40 with four listeners (no filter; ext_proc with
headers CONTINUE + body BUFFERED; ext_authz over gRPC with the body; ext_authz over HTTP with the body) in front of
one fast upstream; a grpc.aio (uvloop) server answers the first two with pre-built answers, a raw uvloop + httptools
server the HTTP checks. No routing work: what each transport costs alone. One client connection, back to back or
with a gap.

Usage: .venv/bin/python bench-results/routing-authz-http/prototype.py NUM_REQUESTS PROMPT_KB GAP_MS
"""
import asyncio, os, socket, statistics, subprocess, sys, tempfile, time, multiprocessing as mp
from prefixroute.extproc.gateway import envoy_binary
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from bench_grpc_transport import cpu_of

UP, GRPC, L0, L1, L2, ADMIN = 18190, 18191, 18180, 18181, 18182, 18189
L3, HTTPZ = 18183, 18192
HDR = "x-gateway-destination-endpoint"

def upstream():
    import uvloop
    body = b'{"ok":true}'
    resp = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    class P(asyncio.Protocol):
        def connection_made(self, t): self.t = t; self.buf = b""
        def data_received(self, d):
            self.buf += d
            while True:
                i = self.buf.find(b"\r\n\r\n")
                if i < 0: return
                head = self.buf[:i].lower(); n = 0
                for line in head.split(b"\r\n"):
                    if line.startswith(b"content-length:"): n = int(line.split(b":")[1])
                if len(self.buf) < i + 4 + n: return
                self.buf = self.buf[i + 4 + n:]
                self.t.write(resp)
    async def main():
        srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", UP)
        await srv.serve_forever()
    uvloop.run(main())

def grpc_server(ready):
    import grpc, uvloop
    from prefixroute.extproc import wire
    from prefixroute.extproc.servicer import ResponseCache
    from envoy_data_plane.envoy.service.auth.v3 import CheckResponse, OkHttpResponse
    from envoy_data_plane.envoy.config.core.v3 import HeaderValueOption, HeaderValue
    from envoy_data_plane.google.rpc import Status
    cont = wire.ProcessingResponse(request_headers=wire.HeadersResponse()).SerializeToString()
    ep = f"127.0.0.1:{UP}"
    routed = ResponseCache().routing_response((ep,), False).SerializeToString()
    ok = bytes(CheckResponse(status=Status(code=0), ok_response=OkHttpResponse(headers=[HeaderValueOption(header=HeaderValue(key=HDR, value=ep))])))
    async def process(requests, context):
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                yield cont
            elif kind == "request_body":
                yield routed
    async def check(request, context):
        return ok
    async def main():
        server = grpc.aio.server()
        wire.add_to_server(server, process)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("envoy.service.auth.v3.Authorization", {
            "Check": grpc.unary_unary_rpc_method_handler(check, request_deserializer=None, response_serializer=None)}),))
        server.add_insecure_port(f"127.0.0.1:{GRPC}")
        await server.start(); ready.set()
        await server.wait_for_termination()
    uvloop.run(main())

def http_server(ready):
    import uvloop, httptools
    ep = f"127.0.0.1:{UP}"
    ok = f"HTTP/1.1 200 OK\r\n{HDR}: {ep}\r\ncontent-length: 0\r\n\r\n".encode()
    class P(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t; self.p = httptools.HttpRequestParser(self); self.body = []
        def data_received(self, d):
            self.p.feed_data(d)
        def on_header(self, k, v): pass
        def on_body(self, b): self.body.append(b)
        def on_message_complete(self):
            self.body = []
            self.t.write(ok)
    async def main():
        srv = await asyncio.get_running_loop().create_server(P, "127.0.0.1", HTTPZ)
        ready.set()
        await srv.serve_forever()
    uvloop.run(main())

ROUTES = f"""
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/", headers: [{{name: {HDR}, present_match: true}}]}}
                route: {{cluster: picked, timeout: 5s}}
              - match: {{prefix: "/"}}
                route: {{cluster: upstream, timeout: 5s}}"""

def listener(name, port, filt):
    return f"""
  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
{ROUTES}
          http_filters:{filt}
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}"""

EXTPROC = """
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {envoy_grpc: {cluster_name: grpc}, timeout: 0.5s}
              failure_mode_allow: true
              message_timeout: 0.5s
              processing_mode: {request_header_mode: SEND, response_header_mode: SKIP, request_body_mode: BUFFERED, response_body_mode: NONE, request_trailer_mode: SKIP, response_trailer_mode: SKIP}
              mutation_rules: {allow_all_routing: true}"""
AUTHZ = """
          - name: envoy.filters.http.ext_authz
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
              grpc_service: {envoy_grpc: {cluster_name: grpc}, timeout: 0.5s}
              transport_api_version: V3
              failure_mode_allow: true
              clear_route_cache: true
              with_request_body: {max_request_bytes: 4194304, allow_partial_message: false, pack_as_bytes: true}"""

AUTHZHTTP = """
          - name: envoy.filters.http.ext_authz
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
              http_service:
                server_uri: {uri: "http://127.0.0.1:18192", cluster: httpz, timeout: 0.5s}
                path_prefix: /check
                authorization_response:
                  allowed_upstream_headers: {patterns: [{exact: x-gateway-destination-endpoint}]}
              transport_api_version: V3
              failure_mode_allow: true
              clear_route_cache: true
              with_request_body: {max_request_bytes: 4194304, allow_partial_message: false}"""

CONFIG = f"""
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {ADMIN}}}}}}}
static_resources:
  listeners:{listener("bare", L0, "")}{listener("extproc", L1, EXTPROC)}{listener("authz", L2, AUTHZ)}{listener("authzhttp", L3, AUTHZHTTP)}
  clusters:
  - name: grpc
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment: {{cluster_name: grpc, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {GRPC}}}}}}}}}]}}]}}
  - name: httpz
    type: STATIC
    load_assignment: {{cluster_name: httpz, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {HTTPZ}}}}}}}}}]}}]}}
  - name: upstream
    type: STATIC
    load_assignment: {{cluster_name: upstream, endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {UP}}}}}}}}}]}}]}}
  - name: picked
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    original_dst_lb_config: {{use_http_header: true, http_header_name: {HDR}}}
"""

def client(port, n, kb, gap_s):
    s = socket.create_connection(("127.0.0.1", port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = b'{"model":"m","prompt":"' + b"a" * (kb * 1024) + b'"}'
    req = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    lat = []
    for _ in range(n):
        t = time.perf_counter(); s.sendall(req); buf = b""
        while True:
            buf += s.recv(65536)
            i = buf.find(b"\r\n\r\n")
            if i >= 0:
                cl = int(buf[:i].lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(buf) >= i + 4 + cl: break
        lat.append(time.perf_counter() - t)
        assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
        if gap_s: time.sleep(gap_s)
    s.close(); return lat

if __name__ == "__main__":
    n = int(sys.argv[1]); kb = int(sys.argv[2]); gap_s = float(sys.argv[3]) / 1e3
    config_path = os.path.join(tempfile.mkdtemp(prefix="authz-proto-"), "envoy.yaml")
    open(config_path, "w").write(CONFIG)
    up = mp.Process(target=upstream); up.start()
    ready = mp.Event(); g = mp.Process(target=grpc_server, args=(ready,)); g.start(); ready.wait(20)
    r2 = mp.Event(); h = mp.Process(target=http_server, args=(r2,)); h.start(); r2.wait(20)
    env = subprocess.Popen([envoy_binary(), "-c", config_path, "--concurrency", "1", "-l", "error"])
    time.sleep(2.5)
    try:
        for port in (L0, L1, L2, L3): client(port, 50, kb, 0)
        
        for rnd in range(3):
            for name, port, srv in (("bare", L0, g), ("extproc", L1, g), ("authz", L2, g), ("authzhttp", L3, h)):
                e0, g0 = cpu_of(env.pid), cpu_of(srv.pid)
                lat = client(port, n, kb, gap_s)
                e1, g1 = cpu_of(env.pid), cpu_of(srv.pid)
                lat.sort()
                print(f"round {rnd+1} {name:8s}: p50 {statistics.median(lat)*1e6:7.1f} us p99 {lat[int(len(lat)*.99)]*1e6:7.1f} us; "
                      f"grpc server CPU {(g1-g0)/n*1e6:6.1f} us/req, Envoy CPU {(e1-e0)/n*1e6:6.1f} us/req", flush=True)
    finally:
        env.terminate(); g.terminate(); h.terminate(); up.terminate()
