"""How much slower the same C work runs after the process sat idle (this host): orjson.loads of one 12 KB chat
body, back to back and after sleeps (or a busy wait) of 1-50 ms.

    .venv/bin/python bench-results/hop-cold/cold_orjson.py
"""
import statistics as st
import time

import orjson

body = orjson.dumps({"model": "m", "stream": True, "messages": [
    {"role": "system", "content": ("You are a helpful assistant. " * 500)[:12 * 1024]},
    {"role": "user", "content": "hi"}]})


def once() -> float:
    t = time.perf_counter()
    orjson.loads(body)
    return (time.perf_counter() - t) * 1e6


for gap in (0, 0.001, 0.005, 0.02, 0.05):
    r = []
    for _ in range(100):
        r.append(once())
        if gap:
            time.sleep(gap)
    print(f"gap {gap * 1e3:g} ms: orjson.loads 12KB median {st.median(r):.1f} us")
r = []
for _ in range(100):
    r.append(once())
    end = time.perf_counter() + 0.05
    while time.perf_counter() < end:
        pass
print(f"busy gap 50 ms: median {st.median(r):.1f} us")
