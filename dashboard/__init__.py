"""The live Streamlit dashboard (`prefixroute dashboard`).

Modules: cli (settings, starting Streamlit), app (the pages: a Streamlit script), source (DataSource: the store,
file or receiver URL, and the router's /metrics), data (query rows -> pandas frames, colours, balance, states),
tables (figures as text, the HTML tables), charts (Altair charts), router_metrics (the router's Prometheus text
-> each endpoint's live figures), bench_results (the Benchmarks page's results.json files), bench_queries and
screenshot (tools).
"""
