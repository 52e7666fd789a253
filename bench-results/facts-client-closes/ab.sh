cd /work/main
for k in 1 2 3 4 5; do
  for v in new old; do
    cp /tmp/luaab/facts_$v.py extproc/envoy_config/facts.py
    echo "== $v $k $(date +%T)"
    timeout 900 .venv/bin/prefixroute overhead-bench --mode latency --num-requests 500 --num-rounds 2 --prompt-kb 4 --stream-tokens 32 --itl-ms 0.5 2>&1 | tail -8
  done
done
cp /tmp/luaab/facts_new.py extproc/envoy_config/facts.py
echo done
