"""Flow control at the gateway: hold, order and shed requests past saturation.

- `saturation`: can some endpoint start a request soon (time model queueing, scraped waiting and KV usage)?
- `queue`: held requests in release order: priority class, tenant fairness, shortest predicted prefill, aging.
- `control`: the pure decisions (admit, hold, release, shed, Retry-After), shared by the live router and the
  virtual fleet.
- `gate`: the live router's asyncio wrapper (a held request is a future: no CPU while it waits).
- `settings`, `metrics`: the typed settings and the /metrics names.
"""
