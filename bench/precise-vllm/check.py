"""Precise mode against two real vLLM engines (by hand; see README "Precise mode").

Needs two vLLM replicas with KV events and replay, block size 32 (the `vllm serve` commands
at the top of router.yaml) and the router started with router.yaml, its JSON log going to a file. Sends chats
with long shared prefixes and reports, per request, the replica the router chose (from
its access log) and the `cached_tokens` that replica reported:

  phase 1  prefixes sent through the router, each three times with a new question:
           the repeats must land where the first went, with cached_tokens > 0;
  phase 2  prefixes warmed on one replica directly, behind the router's back (its tree
           never saw them): the router must still send them there, from the events.

Usage: python3 check.py ROUTER_URL ROUTER_LOG A_URL B_URL   (stdlib only)
"""
import json, random, sys, time, urllib.request

router, log_path, a_url, b_url = sys.argv[1:5]
replicas = {a_url: "A", b_url: "B"}
# Fresh prefixes each run: the replicas keep earlier runs' blocks (and the router learns
# them by replay), so a fixed seed would find phase 1's "first" sends already cached.
seed = int(time.time())
rng = random.Random(seed)
print("seed", seed)
WORDS = ("cache prefix block engine replica token decode prefill router event "
         "stream queue batch tensor layer weight memory latency worker shard").split()


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.headers.get("x-request-id"), json.loads(r.read())


def prefix(n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def chat(system, question):
    return {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def worker_of(request_id):
    for _ in range(50):
        with open(log_path) as f:
            for line in f:
                if request_id in line:
                    fields = json.loads(line).get("fields", {})
                    if "worker" in fields:
                        return replicas.get(fields["worker"].rstrip("/"), fields["worker"])
        time.sleep(0.1)
    return "?"


def send(system, question, via=None):
    rid, resp = post(via or router, chat(system, question))
    cached = (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (worker_of(rid) if via is None else replicas[via]), resp["usage"]["prompt_tokens"], cached


rows, ok = [], True
print("phase 1: prefixes through the router, three questions each")
for p in range(6):
    system = f"[{p}] " + prefix(700)
    first = None
    for q in range(3):
        w, n, cached = send(system, f"question {q} about prefix {p}?")
        first = first or w
        good = (q == 0 and cached == 0) or (q > 0 and w == first and cached > 0)
        ok &= good
        print(f"  prefix {p} q{q}: routed to {w}, prompt {n} tokens, cached {cached}{'' if good else '   <-- unexpected'}")

print("phase 2: prefixes warmed directly on a replica, then sent through the router")
for p in range(6):
    target = [a_url, b_url][p % 2]
    system = f"<{p}> " + prefix(700)
    send(system, "warm-up question", via=target)
    time.sleep(0.3)  # the engine's events reach the router
    w, n, cached = send(system, "the real question")
    good = w == replicas[target] and cached > 0
    ok &= good
    print(f"  prefix {p} warmed on {replicas[target]}: routed to {w}, prompt {n} tokens, cached {cached}{'' if good else '   <-- unexpected'}")

view = json.loads(urllib.request.urlopen(router + "/workers").read())
print("router /workers precise:", json.dumps(view["precise"]["decisions"]))
for wk in view["workers"]:
    e = wk["kv_events"]
    print(f"  {replicas.get(wk['url'].rstrip('/'), wk['url'])}: state {e['state']}, messages {e['messages']}, "
          f"stored {e['stored']}, removed {e['removed']}, blocks {e['blocks']}, malformed {e['malformed']}, "
          f"skipped {e['skipped_events']}, gaps {e['gaps']}, restarts {e['restarts']}")
    ok &= e["malformed"] == 0 and e["skipped_events"] == 0
print("RESULT:", "ok" if ok else "UNEXPECTED ROUTING (see above)")
sys.exit(0 if ok else 1)
