#!/usr/bin/env bash
# Routing quality across engine physics and workloads: trace-matrix once per scenario.
#
#   bench/scenarios.sh [extra trace-matrix flags]
#
# Scenarios: three engine physics (serial: one prefill at a time; parallel: up to 6 at
# full speed; shared: up to 6 sharing one speed, as chunked prefill does) × four
# workloads (the Mooncake conversation slice at 10× and 15× its rate; a few system
# prompts shared by most requests, 10×; a few hundred long documents each read by
# several sessions, 8×), 4 engines of 100,000 KV blocks of 16 tokens, 2,000 requests.
# Contenders: $CONTENDERS (default below: the tree's learning is on by default, so
# `+cache.learn_evictions=false` is learning off; sglang:cache_aware needs the peers'
# virtualenv, see bench/peers/run.sh, and is left out when it is missing).
# PHYSICS may also name `chunked` (vLLM's chunked prefill: a prefill delays the tokens of
# the requests decoding beside it), and CONTENDERS `pd:POLICY` (half the engines prefill,
# half decode, vLLM's NixlConnector hand-off); with one, a table of inter-token latency
# and the router's bypasses follows the main one. Prefill against decode workers:
#   PHYSICS=chunked WORKLOADS="conversation-0.5 conversation-1" \
#     CONTENDERS=cache_aware,pd:cache_aware bench/scenarios.sh
# With MODELS=A,B (any physics and workload): the requests split between those models
# (a conversation keeps its model) and every contender runs on each of $MODEL_LAYOUTS
# (default `separate,shared`: half the engines per model, or every engine serving both
# from one KV cache); a table of wrong-model answers per layout follows the main one.
# Each scenario's table goes to stdout and $OUT/<physics>-<workload>[-models].md (default
# /tmp/scenarios). Builds the workspace (release) first. About 2 minutes a scenario
# on a 2-core machine.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
out="${OUT:-/tmp/scenarios}"
venv="${PEERS_VENV:-/tmp/peers-venv}"
contenders="${CONTENDERS:-round_robin,cache_aware,cache_aware+cache.learn_evictions=false,cost_aware,cost_aware+cache.learn_evictions=false}"
if [ -x "$venv/bin/smg" ] && [ -z "${CONTENDERS:-}" ]; then
    contenders="$contenders,sglang:cache_aware"
fi
physics="${PHYSICS:-serial parallel shared}"
workloads="${WORKLOADS:-conversation-10 conversation-15 system-prompts-10 shared-docs-8}"
models=()
suffix=""
if [ -n "${MODELS:-}" ]; then
    models=(--models "$MODELS" --model-layouts "${MODEL_LAYOUTS:-separate,shared}")
    suffix="-models"
fi

echo "== building (release)" >&2
cargo build --release --workspace >&2
bin="${CARGO_TARGET_DIR:-$repo/target}/release"
mkdir -p "$out"
"$bin/hot-prefix-trace" --kind system-prompts --out "$out/system_prompts.jsonl"
"$bin/hot-prefix-trace" --kind shared-docs --out "$out/shared_docs.jsonl"

status=0
for p in $physics; do
    for w in $workloads; do
        load="${w##*-}"
        case "$w" in
            conversation-*) trace=bench/data/mooncake_conversation_slice.jsonl ;;
            system-prompts-*) trace="$out/system_prompts.jsonl" ;;
            shared-docs-*) trace="$out/shared_docs.jsonl" ;;
            *) echo "$0: unknown workload $w" >&2; exit 2 ;;
        esac
        echo "== $p physics, $w" >&2
        "$bin/trace-matrix" --trace "$trace" --limit 2000 --load "$load" \
            --engines 4 --kv-blocks 100000 --block-size 16 \
            --prefill-physics "$p" --prefill-slots 6 \
            --peer-venv "$venv" --policies "$contenders" --progress-s 0 \
            ${models[@]+"${models[@]}"} "$@" \
            | tee "$out/$p-$w$suffix.md" || status=1
    done
done
echo "== tables in $out" >&2
exit $status
