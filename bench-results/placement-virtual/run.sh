#!/bin/bash
# usage: sweep2.sh SET TAG ENV...  -> bench-results/placement-virtual/SET/TAG, routers incl. sglang model for base
cd "$(dirname "$0")/../.."
set_=$1; tag=$2; shift 2
case $set_ in
capacity-pressure) W="--workload capacity-pressure --num-requests 300 --server-args=--time-scale=1.6,--num-gpu-blocks=2498";;
96x6k) W="--workload capacity-pressure --pressure-num-groups 96 --pressure-min-prefix-tokens 6144 --pressure-max-prefix-tokens 6144 --pressure-zipf-s 0 --pressure-kv-ratio 0.25 --num-requests 576 --server-args=--time-scale=1.6";;
shared-prompts) W="--workload shared-prompts --num-requests 300 --server-args=--time-scale=1.6";;
zipf11-600) W="--workload capacity-pressure --num-requests 600 --pressure-zipf-s 1.1 --seed 3 --server-args=--time-scale=1.6,--num-gpu-blocks=2498";;
seed1-600) W="--workload capacity-pressure --num-requests 600 --seed 1 --server-args=--time-scale=1.6,--num-gpu-blocks=2498";;
mix) W="--workload mix --num-requests 200 --server-args=--time-scale=1.6";;
esac
R=prefixroute:prefix@events
[ "$tag" = off ] && R=prefixroute:prefix@events,sim:sglang-cache-aware
out=bench-results/placement-virtual/$set_/$tag
mkdir -p $out
echo "$* prefixroute bench --virtual $W --servers 4 --profile llama-3.1-70b-h200-tp4 --sweep-load-percents 40,80 --routers $R --out $out" > $out/command.txt
env "$@" prefixroute bench --virtual $W --servers 4 --profile llama-3.1-70b-h200-tp4 --sweep-load-percents 40,80 --routers $R --out $out > $out/stdout.log 2>&1
grep "^| [48]0%" $out/report.md | awk -F'|' -v t="$set_ $tag" '{printf "%-34s %s %s p50 %s p90 %s hit %s share %s\n", t, $2, $4, $5, $6, $8, $9}'
