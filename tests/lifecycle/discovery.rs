//! DNS discovery as an operator sees it: workers follow the A records of a name served
//! by a local DNS stub (tests/support/dns.rs): one joins, one leaves while a request is
//! in flight on it (the request completes), a failing resolver keeps the list.

use std::net::Ipv4Addr;
use std::time::Duration;

use support::dns::DnsStub;
use support::{client::*, observe::*, wait::*, worker::*};

use crate::common::start_router;

const A: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const B: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);

fn config(dns: &DnsStub, port: u16) -> String {
    format!(
        "health:\n  interval_secs: 3600\ndiscovery:\n  dns:\n    name: engines.test.local\n    port: {port}\n    interval_secs: 0.1\n    resolver: \"{}\"\n",
        dns.addr
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_the_records_and_a_leaving_one_finishes_its_requests() {
    let gate = Gate::new();
    let (a, b) = workers_on_one_port(&gate).await;
    let port = a.port();
    let dns = DnsStub::start(&[A]).await;
    let router = start_router(&config(&dns, port)).await;
    let r = router.addr;
    let url_a = format!("http://127.0.0.2:{port}");
    let url_b = format!("http://127.0.0.3:{port}");
    wait_until("A discovered", Duration::from_secs(5), || async {
        worker_urls(r).await == vec![url_a.clone()]
    })
    .await;
    // A long prompt, so that its follow-up is a cache hit on A.
    let long = long_prompt_served_by_first(r, &[&a, &b]).await;

    // B joins.
    dns.set(&[A, B]);
    wait_until("B joins", Duration::from_secs(5), || async {
        worker_urls(r).await.len() == 2
    })
    .await;

    // A leaves while a request is in flight on it: that request still completes.
    let pending = spawn_chat(r, format!("{long} hold"));
    a.wait_for_requests(2).await;
    dns.set(&[B]);
    wait_until("A leaves", Duration::from_secs(5), || async {
        worker_urls(r).await == vec![url_b.clone()]
    })
    .await;
    for i in 0..4 {
        let (resp, by) = send_tagged(
            r,
            &[&a, &b],
            Req::post("/v1/chat/completions", chat_body(&format!("q{i}"), false)),
        )
        .await;
        assert_eq!((resp.status, by), (200, 1), "only B takes new requests");
    }
    gate.open();
    let held = within("the request on the leaving worker", pending)
        .await
        .unwrap();
    assert_eq!(held.status, 200, "nothing lost while A left");

    // A resolver that fails keeps the list as it was.
    dns.fail(true);
    let asked = dns.queries();
    wait_until("lookups keep failing", Duration::from_secs(5), || async {
        dns.queries() >= asked + 3
    })
    .await;
    assert_eq!(worker_urls(r).await, vec![url_b.clone()]);
    let (resp, _) = send_tagged(
        r,
        &[&a, &b],
        Req::post("/v1/chat/completions", chat_body("y", false)),
    )
    .await;
    assert_eq!(resp.status, 200);
    router.shutdown().await;
}
