//! WebSocket on both ends of a tunnel test: the handshake's accept key (RFC 6455 §4.2.2,
//! SHA-1 and base64 written out here, no crate for them), frames written and read, the
//! mock worker's echo ([`crate::worker::Step::EchoWebSocket`]), and a raw client.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::wait::within;

/// The key RFC 6455 §1.3 uses as its example, whose accept value it gives.
pub const SAMPLE_KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

/// `Sec-WebSocket-Accept` for `key`: base64(SHA-1(key + the RFC's GUID)).
pub fn accept_key(key: &str) -> String {
    let digest = sha1(format!("{key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11").as_bytes());
    base64(&digest)
}

fn sha1(data: &[u8]) -> [u8; 20] {
    let mut h: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks(64) {
        let mut w = [0u32; 80];
        for (i, c) in block.chunks(4).enumerate() {
            w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, wi) in w.iter().enumerate() {
            let (f, k) = match i {
                0..=19 => ((b & c) | (!b & d), 0x5A827999),
                20..=39 => (b ^ c ^ d, 0x6ED9EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1BBCDC),
                _ => (b ^ c ^ d, 0xCA62C1D6),
            };
            let t = a
                .rotate_left(5)
                .wrapping_add(f)
                .wrapping_add(e)
                .wrapping_add(k)
                .wrapping_add(*wi);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = t;
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 20];
    for (i, x) in h.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&x.to_be_bytes());
    }
    out
}

fn base64(data: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Opcodes used here.
pub const TEXT: u8 = 1;
pub const CLOSE: u8 = 8;

/// One final frame; masked (as a client must send) when `mask` is given.
pub fn frame(opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = vec![0x80 | opcode];
    let m = if mask.is_some() { 0x80 } else { 0 };
    match payload.len() {
        n if n < 126 => out.push(m | n as u8),
        n if n <= 0xffff => {
            out.push(m | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(m | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    match mask {
        Some(k) => {
            out.extend_from_slice(&k);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
        }
        None => out.extend_from_slice(payload),
    }
    out
}

/// Reads one frame: `(opcode, masked, payload unmasked)`; `None` at end of stream.
pub async fn read_frame(s: &mut TcpStream) -> std::io::Result<Option<(u8, bool, Vec<u8>)>> {
    let mut head = [0u8; 2];
    match s.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let masked = head[1] & 0x80 != 0;
    let len = match head[1] & 0x7f {
        126 => s.read_u16().await? as usize,
        127 => s.read_u64().await? as usize,
        n => n as usize,
    };
    let mut key = [0u8; 4];
    if masked {
        s.read_exact(&mut key).await?;
    }
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).await?;
    if masked {
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= key[i % 4];
        }
    }
    Ok(Some((head[0] & 0x0f, masked, payload)))
}

/// The mock worker's side after its 101: every frame the client sends comes back
/// unmasked with the same opcode, a close frame included, after which it returns.
/// A client frame that is not masked is refused (the connection is dropped), as
/// RFC 6455 §5.1 has servers do.
pub async fn echo_frames(s: &mut TcpStream) -> std::io::Result<()> {
    while let Some((opcode, masked, payload)) = read_frame(s).await? {
        if !masked {
            return Ok(());
        }
        s.write_all(&frame(opcode, &payload, None)).await?;
        if opcode == CLOSE {
            return Ok(());
        }
    }
    Ok(())
}

/// A client's WebSocket handshake on `path`: the status, the head's header lines, and
/// the stream (positioned after the head: the router sends nothing after a 101 until
/// the worker does).
pub async fn handshake(
    addr: SocketAddr,
    path: &str,
    key: &str,
) -> (u16, Vec<(String, String)>, TcpStream) {
    let mut s = within("connect", TcpStream::connect(addr)).await.unwrap();
    let req = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Byte by byte: nothing past the head may be taken from the stream.
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let b = within("handshake answer", s.read_u8()).await.unwrap();
        head.push(b);
    }
    let text = String::from_utf8(head).unwrap();
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect();
    (status, headers, s)
}
