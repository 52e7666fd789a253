import time, statistics as st, sys, numpy as np, orjson
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.tokens import PromptHasher
mode = sys.argv[1]
settings = RoutingSettings(tokenizer="sim") if mode == "tok" else RoutingSettings()
hasher = PromptHasher.from_settings(settings)
from prefixroute.extproc.routing.text_hash_cache import TextHashCache
tc = TextHashCache.from_settings(settings) if len(sys.argv) > 2 else None
sysmsg = ("You are a helpful assistant for tenant 7. " * 400)[:12*1024]
def body(i):
    msgs=[{"role":"system","content":sysmsg}]
    for t in range(i%4):
        msgs += [{"role":"user","content":f"question {t} "*20},{"role":"assistant","content":f"answer {t} "*10}]
    msgs.append({"role":"user","content":f"new question {i} " * 20})
    return orjson.dumps({"model":"m","stream":True,"max_tokens":32,"messages":msgs})
bodies=[body(i) for i in range(200)]
junk = np.zeros(32<<20, dtype=np.uint8)
for cold in (False, True):
    ts=[]
    for i,b in enumerate(bodies*3):
        if cold: junk += 1  # evict caches
        t=time.perf_counter()
        parse_request("POST","/v1/chat/completions",{"x-request-id":"r"},b,settings,hasher,None,tc)
        ts.append((time.perf_counter()-t)*1e6)
    print(mode, "cold" if cold else "warm", "median us %.1f p90 %.1f" % (st.median(ts), sorted(ts)[int(len(ts)*.9)]))
