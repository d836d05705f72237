//! HTTP/1.1 framing shared by the mock worker and the client: buffered reads of heads,
//! lines, exact lengths and chunked bodies over any stream, and header lookups.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;

/// The first value of header `name` (case-insensitive).
pub(crate) fn header_in<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Every value of header `name` (case-insensitive).
pub(crate) fn header_all_in<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .collect()
}

/// Method, target and header lines of a request.
pub(crate) type RequestHead = (String, String, Vec<(String, String)>);

pub(crate) fn parse_request_head(head: &[u8]) -> Option<RequestHead> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.splitn(3, ' ');
    let method = first.next()?.to_string();
    let target = first.next()?.to_string();
    first.next()?; // the version
    let headers = parse_header_lines(lines)?;
    Some((method, target, headers))
}

/// `name: value` lines, up to the end of `lines`; `None` on a line without a colon.
pub(crate) fn parse_header_lines<'a>(
    lines: impl Iterator<Item = &'a str>,
) -> Option<Vec<(String, String)>> {
    let mut headers = Vec::new();
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let (k, v) = line.split_once(':')?;
        headers.push((k.to_string(), v.trim_matches([' ', '\t']).to_string()));
    }
    Some(headers)
}

/// Buffered reads over a stream.
pub(crate) struct Wire<S = TcpStream> {
    pub(crate) stream: S,
    pub(crate) buf: BytesMut,
}

impl<S: AsyncRead + Unpin> Wire<S> {
    pub(crate) fn new(stream: S) -> Self {
        Wire {
            stream,
            buf: BytesMut::with_capacity(64 * 1024),
        }
    }

    /// Reads more bytes into the buffer; `Ok(0)` at end of stream.
    pub(crate) async fn fill(&mut self) -> std::io::Result<usize> {
        if self.buf.capacity() - self.buf.len() < 16 * 1024 {
            self.buf.reserve(64 * 1024);
        }
        self.stream.read_buf(&mut self.buf).await
    }

    /// The bytes up to and including the blank line ending a head; `None` on a clean EOF
    /// before any byte.
    pub(crate) async fn read_head(&mut self) -> std::io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                return Ok(Some(self.buf.split_to(i + 4).to_vec()));
            }
            if self.fill().await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    pub(crate) async fn read_line(&mut self) -> std::io::Result<Vec<u8>> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n") {
                let line = self.buf.split_to(i + 2);
                return Ok(line[..i].to_vec());
            }
            if self.fill().await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }

    pub(crate) async fn read_exact(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill().await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.split_to(n).to_vec())
    }

    pub(crate) async fn read_chunked(&mut self) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::new();
        loop {
            let line = self.read_line().await?;
            let size = chunk_size(&line)?;
            if size == 0 {
                // Trailers, then the blank line.
                while !self.read_line().await?.is_empty() {}
                return Ok(out);
            }
            out.extend_from_slice(&self.read_exact(size).await?);
            if !self.read_line().await?.is_empty() {
                return Err(std::io::Error::other("chunk not followed by CRLF"));
            }
        }
    }
}

/// The size on a chunk-size line (extensions ignored).
pub(crate) fn chunk_size(line: &[u8]) -> std::io::Result<usize> {
    let text = std::str::from_utf8(line).map_err(std::io::Error::other)?;
    let hex = text.split(';').next().unwrap_or("").trim();
    usize::from_str_radix(hex, 16)
        .map_err(|e| std::io::Error::other(format!("bad chunk size {text:?}: {e}")))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
