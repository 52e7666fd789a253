"""The endpoint pool: membership, health (active probes + passive failures), model lists, load metrics
(Prometheus scrape of vLLM/SGLang names) and the router's in-flight counts. I/O lives here, not in routing/."""
