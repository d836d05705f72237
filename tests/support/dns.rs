//! A DNS server stub on a loopback UDP port for discovery tests: answers A queries for
//! every name with the addresses the test sets (TTL 0), AAAA with none; can be told to
//! fail (SERVFAIL). Just enough of RFC 1035 for a stub resolver.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::net::UdpSocket;

#[derive(Default)]
struct Zone {
    addrs: Vec<Ipv4Addr>,
    fail: bool,
    queries: usize,
}

pub struct DnsStub {
    pub addr: SocketAddr,
    zone: Arc<Mutex<Zone>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DnsStub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DnsStub {
    pub async fn start(addrs: &[Ipv4Addr]) -> DnsStub {
        let sock = UdpSocket::bind("127.0.0.1:0").await.expect("bind DNS stub");
        let addr = sock.local_addr().expect("DNS stub address");
        let zone = Arc::new(Mutex::new(Zone {
            addrs: addrs.to_vec(),
            ..Zone::default()
        }));
        let z = Arc::clone(&zone);
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                if let Some(reply) = answer(&buf[..n], &z) {
                    let _ = sock.send_to(&reply, from).await;
                }
            }
        });
        DnsStub { addr, zone, task }
    }

    /// The addresses every A query gets from now on.
    pub fn set(&self, addrs: &[Ipv4Addr]) {
        self.zone.lock().unwrap().addrs = addrs.to_vec();
    }

    /// Answer SERVFAIL to everything (or stop).
    pub fn fail(&self, fail: bool) {
        self.zone.lock().unwrap().fail = fail;
    }

    pub fn queries(&self) -> usize {
        self.zone.lock().unwrap().queries
    }
}

/// The reply to one query: its id and question, then the answers.
fn answer(q: &[u8], zone: &Mutex<Zone>) -> Option<Vec<u8>> {
    if q.len() < 12 {
        return None;
    }
    // The question: labels up to the root, then type and class.
    let mut i = 12;
    while *q.get(i)? != 0 {
        i += 1 + q[i] as usize;
    }
    let qtype = u16::from_be_bytes([*q.get(i + 1)?, *q.get(i + 2)?]);
    let question = &q[12..i + 5];
    let mut z = zone.lock().unwrap();
    z.queries += 1;
    let answers: Vec<Ipv4Addr> = if qtype == 1 && !z.fail {
        z.addrs.clone()
    } else {
        vec![]
    };
    let rcode = if z.fail { 2 } else { 0 };
    let mut r = Vec::with_capacity(64);
    r.extend_from_slice(&q[..2]);
    // QR, opcode 0, AA, RD copied; RA; rcode.
    r.push(0x84 | (q[2] & 0x01));
    r.push(0x80 | rcode);
    r.extend_from_slice(&1u16.to_be_bytes());
    r.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    r.extend_from_slice(&[0, 0, 0, 0]);
    r.extend_from_slice(question);
    for a in answers {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
        r.extend_from_slice(&a.octets());
    }
    Some(r)
}
