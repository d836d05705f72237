#!/usr/bin/env bash
# Side by side with the peer routers (README: Performance > Against the peer routers).
#
#   bench/peers/run.sh [all|trace|overhead] [extra flags for that binary]
#
# 1. Installs sglang-router and vllm-router from PyPI into a throwaway virtualenv
#    OUTSIDE the repository ($PEERS_VENV, default /tmp/peers-venv), unless the
#    pinned versions are already there.
# 2. Builds the workspace (release; honours CARGO_TARGET_DIR).
# 3. trace:    trace-matrix over the Mooncake slice with the contenders
#              ideal, round_robin, cache_aware, sglang:cache_aware, vllm:cache_aware
#              (4 cold engines each; ~5 minutes).
#    overhead: peer-overhead: added latency and requests/s of the three routers
#              with 1 and 2 engines at 1, 64 and 512 clients (~4 minutes).
# Tables go to stdout and to $PEERS_OUT (default /tmp/peers-results)/{trace,overhead}.md.
# ROUTER_BIN=/path/to/cache-aware-router measures that build of our router instead
# of the workspace's (only the bench crate is built then).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
venv="${PEERS_VENV:-/tmp/peers-venv}"
out="${PEERS_OUT:-/tmp/peers-results}"
sglang_version=0.3.2
vllm_version=0.1.17
what="${1:-all}"
[ $# -gt 0 ] && shift
case "$what" in all|trace|overhead) ;; *)
    echo "usage: $0 [all|trace|overhead] [extra flags]" >&2; exit 2;;
esac
if [ "$what" = all ] && [ $# -gt 0 ]; then
    echo "$0: extra flags need 'trace' or 'overhead' first" >&2; exit 2
fi

mkdir -p "$(dirname "$venv")"
venv_abs="$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"
case "$venv_abs/" in "$repo"/*)
    echo "$0: PEERS_VENV must be outside the repository ($venv_abs)" >&2; exit 2;;
esac

installed() {
    "$venv/bin/python" - "$sglang_version" "$vllm_version" <<'PY' 2>/dev/null
import sys, importlib.metadata as m
sys.exit(0 if (m.version("sglang-router"), m.version("vllm-router")) == tuple(sys.argv[1:3]) else 1)
PY
}
if ! installed; then
    echo "== installing sglang-router $sglang_version and vllm-router $vllm_version into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check \
        "sglang-router==$sglang_version" "vllm-router==$vllm_version"
    installed || { echo "$0: the peers did not install" >&2; exit 1; }
fi

echo "== building (release)" >&2
bin="${CARGO_TARGET_DIR:-$repo/target}/release"
if [ -n "${ROUTER_BIN:-}" ]; then
    cargo build --release -p bench >&2
    router=(--router-bin "$ROUTER_BIN")
else
    cargo build --release --workspace >&2
    router=()
fi
mkdir -p "$out"

status=0
if [ "$what" = all ] || [ "$what" = trace ]; then
    echo "== trace-matrix (about 5 minutes)" >&2
    "$bin/trace-matrix" --peer-venv "$venv" "${router[@]}" \
        --policies ideal,round_robin,cache_aware,sglang:cache_aware,vllm:cache_aware \
        --progress-s 0 "$@" | tee "$out/trace.md" || status=1
fi
if [ "$what" = all ] || [ "$what" = overhead ]; then
    echo "== peer-overhead (about 4 minutes)" >&2
    # Ours at warn, as the peers (--peer-log-level warn): no line per request.
    "$bin/peer-overhead" --peer-venv "$venv" "${router[@]}" --router-log-level warn "$@" | tee "$out/overhead.md" || status=1
fi
echo "== tables in $out" >&2
exit $status
