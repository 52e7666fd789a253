"""One ext_authz HTTP check's round trip to a router, back to back or after an idle gap, from a raw socket.

    .venv/bin/prefixroute model-server --port 18001 &
    .venv/bin/prefixroute extproc --port 18002 --authz-http-port 18003 --endpoints 127.0.0.1:18001 &
    .venv/bin/python bench-results/hop-cold/direct_check_rtt.py 18003 0 300      # back to back
    .venv/bin/python bench-results/hop-cold/direct_check_rtt.py 18003 0.05 200   # 50 ms apart

The check is what Envoy sends (a 12 KB streamed chat body under /check), without the facts header: each pick is
released at its decision, so a long run never fills the endpoint.
"""
import socket
import statistics as st
import sys
import time

import orjson

body = orjson.dumps({"model": "m", "stream": True, "max_tokens": 4, "messages": [
    {"role": "system", "content": ("You are a helpful assistant. " * 500)[:12 * 1024]},
    {"role": "user", "content": "hi"}]})
req = (b"POST /check/v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
       b"x-request-id: r\r\nx-prefixroute-handoff: ext_proc\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
gap, n = float(sys.argv[2]), int(sys.argv[3])
r = []
for _ in range(n):
    t = time.perf_counter()
    s.sendall(req)
    s.recv(65536)
    r.append((time.perf_counter() - t) * 1e6)
    if gap:
        time.sleep(gap)
print(f"gap {gap * 1e3:g} ms: rtt median {st.median(r):.0f} us")
