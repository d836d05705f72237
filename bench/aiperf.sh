#!/usr/bin/env bash
# Replays a slice of the Mooncake conversation trace with aiperf (NVIDIA's load tool,
# PyPI `aiperf`) through cache-aware-router in front of 4 simulated vLLM engines, and
# prints aiperf's own report (TTFT, ITL, throughput, "Usage Prompt Cache Read %").
#
#   bench/aiperf.sh                      # cache_aware, the defaults below
#   POLICY=round_robin bench/aiperf.sh   # a baseline policy, same everything else
#
# Needs: release binaries (`cargo build --release --workspace`), python3, and PyPI for
# the first run (aiperf's venv, ~1.2 GB, goes to $AIPERF_VENV, outside the repository).
# Offline: aiperf always loads a tokenizer and `--tokenizer builtin` still reaches the
# internet, so a small byte-level BPE is trained here on the replayed prompts and put
# in a private Hugging Face cache under a made-up id (local/toytok); HF_HUB_OFFLINE=1.
# Token counts come from the engine (`--use-server-token-count`), not from it.
#
# Settings (environment): LIMIT requests (300), TIME_SCALE on trace timestamps and on
# every simulated duration (0.25), KV_BLOCKS per engine (64000 blocks of 16 tokens),
# POLICY (cache_aware), WORK folder ($TMPDIR/aiperf-work), AIPERF_VENV
# ($TMPDIR/aiperf-venv).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
LIMIT="${LIMIT:-300}"
TIME_SCALE="${TIME_SCALE:-0.25}"
KV_BLOCKS="${KV_BLOCKS:-64000}"
POLICY="${POLICY:-cache_aware}"
tmp="${TMPDIR:-/tmp}"
WORK="${WORK:-$tmp/aiperf-work}"
AIPERF_VENV="${AIPERF_VENV:-$tmp/aiperf-venv}"
AIPERF_VERSION=0.13.0
bin="${CARGO_TARGET_DIR:-$repo/target}/release"

for b in sim-engine cache-aware-router expand-prompts; do
  [[ -x "$bin/$b" ]] || { echo "missing $bin/$b: run cargo build --release --workspace" >&2; exit 2; }
done
mkdir -p "$WORK"

# 1. aiperf in its own venv (pinned).
if ! "$AIPERF_VENV/bin/aiperf" --version >/dev/null 2>&1; then
  python3 -m venv "$AIPERF_VENV"
  "$AIPERF_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "aiperf==$AIPERF_VERSION" tokenizers
fi

# 2. The trace slice as literal prompts (the same bytes trace-matrix sends), time-scaled.
slice="$WORK/slice-$LIMIT-$TIME_SCALE.jsonl"
if [[ ! -s "$slice" ]]; then
  "$bin/expand-prompts" "$repo/bench/data/mooncake_conversation_slice.jsonl" \
    --limit "$LIMIT" --time-scale "$TIME_SCALE" > "$slice.tmp"
  mv "$slice.tmp" "$slice"
fi

# 3. The offline tokenizer: local/toytok in a private HF cache.
export HF_HOME="$WORK/hf" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
snap="$HF_HOME/hub/models--local--toytok/snapshots/0000000000000000000000000000000000000000"
if [[ ! -s "$snap/tokenizer.json" ]]; then
  mkdir -p "$snap" "$HF_HOME/hub/models--local--toytok/refs"
  printf 0000000000000000000000000000000000000000 > "$HF_HOME/hub/models--local--toytok/refs/main"
  "$AIPERF_VENV/bin/python" - "$slice" "$snap" <<'EOF'
import itertools, json, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
slice_path, out = sys.argv[1], sys.argv[2]
lines = (json.loads(l)["text_input"] for l in open(slice_path))
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(itertools.islice(lines, 20), trainer)
tok.save(f"{out}/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
           "eos_token": "<|endoftext|>", "bos_token": None, "unk_token": None},
          open(f"{out}/tokenizer_config.json", "w"))
EOF
fi

# 4. Four engines and the router, on free ports; all stopped on exit.
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
workers=""
for i in 0 1 2 3; do
  "$bin/sim-engine" --port 0 --name "e$i" --kv-blocks "$KV_BLOCKS" --time-factor "$TIME_SCALE" \
    > "$WORK/e$i.out" 2>&1 &
  pids+=($!)
done
for i in 0 1 2 3; do
  for _ in $(seq 100); do grep -q listening "$WORK/e$i.out" && break; sleep 0.1; done
  workers+="  - url: $(grep -o 'http://[0-9.:]*' "$WORK/e$i.out")"$'\n'
done
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
cat > "$WORK/router.yaml" <<EOF
policy: $POLICY
server:
  host: 127.0.0.1
  port: $port
workers:
$workers
log:
  level: warn
EOF
"$bin/cache-aware-router" -c "$WORK/router.yaml" > "$WORK/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done

# 5. aiperf replays the slice on its schedule, streamed chat, server token counts.
# (Its memory-mapped dataset goes to TMPDIR: kept inside $WORK and removed after.)
out="$WORK/out-$POLICY"
rm -rf "$out" "$WORK/aiperf-tmp"
mkdir -p "$WORK/aiperf-tmp"
TMPDIR="$WORK/aiperf-tmp" "$AIPERF_VENV/bin/aiperf" profile \
  --model m --tokenizer local/toytok \
  --url "http://127.0.0.1:$port" --endpoint-type chat --streaming \
  --input-file "$slice" --custom-dataset-type mooncake_trace --fixed-schedule \
  --use-server-token-count --random-seed 0 \
  --artifact-dir "$out" --ui-type simple
rm -rf "$WORK/aiperf-tmp"
echo "aiperf artifacts: $out"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^cache_aware_router_(engine_(cached|prompt)_tokens_total|routing_decisions_total)' || true
