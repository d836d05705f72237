//! The admission queue with classes and tenants: strict order across classes, shedding
//! the least urgent first (429 + `Retry-After`, a body naming the limit, never a 5xx),
//! bounds per class, fair shares of tokens across tenants, pre-emption only before the
//! worker's answer.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::{client::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

/// One worker taking one request at a time: a request with `x-hold` waits for `gate`,
/// any other is answered after `serve`.
async fn one_slot_worker(gate: &Gate, serve: Duration) -> FakeWorker {
    let gate = gate.clone();
    FakeWorker::start_with(move |r| {
        if r.has_header("x-hold") {
            Reply::ok().after_gate(&gate)
        } else {
            Reply::ok().after(serve)
        }
    })
    .await
}

fn router_yaml(w: &FakeWorker, extra: &str) -> String {
    format!(
        "proxy:\n  max_retries: 0\n  queue:\n    max_waiting: 16\n    timeout_ms: 10000\nhealth:\n  interval_secs: 60\nworkers:\n  - url: \"{}\"\n    max_load: 1\n{extra}",
        w.url()
    )
}

/// A chat request of `class` (and tenant, when given), tagged `tag`.
fn request(tag: &str, class: &str, tenant: Option<&str>) -> Req {
    let mut r = Req::post("/v1/chat/completions", chat_body(tag, false))
        .header("x-test-tag", tag)
        .header("x-priority", class);
    if let Some(t) = tenant {
        r = r.header("x-tenant-id", t);
    }
    r
}

fn spawn_send(addr: SocketAddr, req: Req) -> tokio::task::JoinHandle<Response> {
    tokio::spawn(async move { send(addr, &req).await })
}

async fn wait_queued(addr: SocketAddr, n: f64) {
    wait_until(&format!("{n} queued"), STEP_TIMEOUT, || async {
        scrape(addr)
            .await
            .value("cache_aware_router_queue_waiting", &[])
            == n
    })
    .await;
}

/// Takes the one slot with a request held at the worker until `gate` opens.
async fn hold_the_slot(addr: SocketAddr) -> tokio::task::JoinHandle<Response> {
    let holder = spawn_send(
        addr,
        request("holder", "standard", None).header("x-hold", "1"),
    );
    wait_until("the slot taken", STEP_TIMEOUT, || async {
        get_workers(addr).await["workers"][0]["in_flight"] == 1
    })
    .await;
    holder
}

/// The tags of the chat requests the worker received, in arrival order.
fn arrival_order(w: &FakeWorker) -> Vec<String> {
    w.requests()
        .iter()
        .filter_map(|r| r.header("x-test-tag").map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_more_urgent_class_goes_first_whatever_the_arrival_order() {
    let gate = Gate::new();
    let w = one_slot_worker(&gate, Duration::from_millis(10)).await;
    let router = start_router(&router_yaml(&w, "priority: {}\n")).await;
    let addr = router.addr;
    let holder = hold_the_slot(addr).await;
    let mut waiting = Vec::new();
    for (i, class) in ["batch", "standard", "interactive", "critical", "batch"]
        .iter()
        .enumerate()
    {
        waiting.push(spawn_send(
            addr,
            request(&format!("{class}-{i}"), class, None),
        ));
        wait_queued(addr, (i + 1) as f64).await;
    }
    gate.open();
    assert_eq!(holder.await.unwrap().status, 200);
    for h in waiting {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(
        arrival_order(&w),
        [
            "holder",
            "critical-3",
            "interactive-2",
            "standard-1",
            "batch-0",
            "batch-4"
        ]
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_the_least_urgent_first_with_429_naming_the_limit() {
    let gate = Gate::new();
    let w = one_slot_worker(&gate, Duration::from_millis(10)).await;
    let yaml = router_yaml(&w, "priority: {}\n").replace("max_waiting: 16", "max_waiting: 2");
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let holder = hold_the_slot(addr).await;
    let batch = spawn_send(addr, request("batch", "batch", None));
    wait_queued(addr, 1.0).await;
    let standard = spawn_send(addr, request("standard", "standard", None));
    wait_queued(addr, 2.0).await;
    // Full: a critical request takes the batch request's place…
    let critical = spawn_send(addr, request("critical", "critical", None));
    let shed = within("the batch request shed", batch).await.unwrap();
    // …a batch request finds nothing less urgent to shed, nor does a standard one.
    let late_batch = send(addr, &request("late-batch", "batch", None)).await;
    let late_standard = send(addr, &request("late-standard", "standard", None)).await;
    for r in [&shed, &late_batch, &late_standard] {
        assert_eq!(r.status, 429, "{}", r.text());
        assert_eq!(r.header("retry-after"), Some("1"));
        let e = &r.json()["error"];
        assert_eq!(e["type"], "queue_full");
        assert_eq!(e["code"], 429);
        let message = e["message"].as_str().unwrap();
        assert!(message.contains("proxy.queue.max_waiting: 2"), "{message}");
    }
    assert!(
        shed.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("class `batch`")
    );
    gate.open();
    for h in [holder, critical, standard] {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(arrival_order(&w), ["holder", "critical", "standard"]);
    let m = scrape(addr).await;
    assert_eq!(
        m.value(
            "cache_aware_router_queue_rejected_total",
            &[("cause", "full")]
        ),
        3.0
    );
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_that_fills_the_queue_gives_way_to_a_lighter_one_of_its_class() {
    let gate = Gate::new();
    let w = one_slot_worker(&gate, Duration::from_millis(10)).await;
    let yaml = router_yaml(&w, "tenants:\n  list: {light: {}, heavy: {}}\n")
        .replace("max_waiting: 16", "max_waiting: 2");
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let holder = hold_the_slot(addr).await;
    let heavy_1 = spawn_send(addr, request("heavy-1", "standard", Some("heavy")));
    wait_queued(addr, 1.0).await;
    let heavy_2 = spawn_send(addr, request("heavy-2", "standard", Some("heavy")));
    wait_queued(addr, 2.0).await;
    // Full of the heavy tenant's requests: the light one takes its newest's place…
    let light = spawn_send(addr, request("light-1", "standard", Some("light")));
    let shed = within("the heavy tenant's newest shed", heavy_2)
        .await
        .unwrap();
    assert_eq!(shed.status, 429, "{}", shed.text());
    assert_eq!(shed.json()["error"]["type"], "queue_full");
    // …but the heavy one cannot take it back: it would hold more than the light one.
    let heavy_3 = send(addr, &request("heavy-3", "standard", Some("heavy"))).await;
    assert_eq!(heavy_3.status, 429, "{}", heavy_3.text());
    gate.open();
    for h in [holder, heavy_1, light] {
        assert_eq!(h.await.unwrap().status, 200);
    }
    let mut served = arrival_order(&w);
    served[1..].sort();
    assert_eq!(served, ["holder", "heavy-1", "light-1"]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_bound_and_a_class_time_out_name_their_keys() {
    let gate = Gate::new();
    let w = one_slot_worker(&gate, Duration::from_millis(10)).await;
    let extra = "priority: {}\n";
    let yaml = router_yaml(&w, extra).replace(
        "    timeout_ms: 10000\n",
        "    timeout_ms: 10000\n    per_class:\n      batch: {max_waiting: 1, timeout_ms: 300}\n",
    );
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let holder = hold_the_slot(addr).await;
    let first = spawn_send(addr, request("batch-1", "batch", None));
    wait_queued(addr, 1.0).await;
    let second = send(addr, &request("batch-2", "batch", None)).await;
    assert_eq!(second.status, 429);
    let e = &second.json()["error"];
    assert_eq!(e["type"], "class_queue_full");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("proxy.queue.per_class.batch.max_waiting: 1"),
        "{e}"
    );
    let first = within("the batch wait ran out", first).await.unwrap();
    assert_eq!(first.status, 429);
    let e = &first.json()["error"];
    assert_eq!(e["type"], "queue_timeout");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("proxy.queue.per_class.batch.timeout_ms: 300"),
        "{e}"
    );
    gate.open();
    assert_eq!(holder.await.unwrap().status, 200);
    router.shutdown().await;
}

/// Open-loop senders: `n` requests from `tenant`, one every `every`, each with a prompt
/// of `bytes`; each one's time from send to answer, `None` when it failed.
fn open_loop(
    addr: SocketAddr,
    tenant: &'static str,
    n: usize,
    every: Duration,
    bytes: usize,
) -> tokio::task::JoinHandle<Vec<Option<Duration>>> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        // Owned here: aborting this task drops every request still out.
        let mut sent = tokio::task::JoinSet::new();
        for i in 0..n {
            tick.tick().await;
            let prompt = format!("{tenant} {i} {}", "x".repeat(bytes));
            let req = Req::post("/v1/chat/completions", chat_body(&prompt, false))
                .header("x-tenant-id", tenant);
            sent.spawn(async move {
                let t = Instant::now();
                let r = send(addr, &req).await;
                (r.status == 200).then(|| t.elapsed())
            });
        }
        sent.join_all().await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_gets_its_demand_while_a_heavy_one_floods_the_class() {
    // One slot, 40 ms a request: 25 requests a second. Both tenants send 20 a second,
    // the heavy one with ten times the prompt tokens: the requests are short, so FIFO
    // would admit each tenant about 12.5 a second and the light one's waits would grow
    // without end; by tokens, the light one's whole demand fits its share.
    let w = FakeWorker::start_with(|_| Reply::ok().after(Duration::from_millis(40))).await;
    let yaml = router_yaml(&w, "tenants:\n  list: {light: {}, heavy: {}}\n")
        .replace("max_waiting: 16", "max_waiting: 1000")
        .replace("timeout_ms: 10000", "timeout_ms: 60000");
    let router = start_router(&yaml).await;
    let addr = router.addr;
    let every = Duration::from_millis(50);
    let heavy = open_loop(addr, "heavy", 80, every, 4000);
    let light = open_loop(addr, "light", 60, every, 400);
    let light = light.await.unwrap();
    heavy.abort();
    // Admitted promptly: answered within a second (ten service times) of being sent.
    let prompt = light
        .iter()
        .filter(|t| t.is_some_and(|t| t < Duration::from_secs(1)))
        .count();
    assert!(
        prompt * 10 >= light.len() * 9,
        "only {prompt} of the light tenant's {} requests were admitted promptly: {light:?}",
        light.len()
    );
    router.shutdown().await;
}
