//! The fleet channel's messages: one Redis `PUBLISH` carries a batch of records from one
//! replica. Binary, little-endian:
//!
//! ```text
//! "CARF" u8 version(1) u64 replica   then records until the end:
//!   u8 1 (prefix)  u64 worker key hash, u16 n, n × u64 chained chunk hashes
//!   u8 2 (load)    u16 n, n × (u64 worker key hash, u32 requests in flight)
//!   u8 3 (binding) u8 map (1 session, 2 conversation), u64 key hash, u64 worker key hash
//! ```
//!
//! A worker is named by the xxh3-64 of its stable key (its `name`, else its normalised
//! URL), so replicas with the same worker list agree without sending URLs; the prompt is
//! never sent, only the chain of chunk hashes (see `super::chain`).

const MAGIC: &[u8; 4] = b"CARF";
const VERSION: u8 = 1;
/// Magic, version, replica.
const HEADER: usize = 4 + 1 + 8;
/// Most hashes one prefix record carries (a 32 KiB routing text at 128-byte chunks is
/// 256).
pub const MAX_CHAIN: usize = u16::MAX as usize;

/// One record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// The worker now holds this chain of chunks (chunk 0 first; each hash names the
    /// whole prefix up to it).
    Prefix { worker: u64, chain: Vec<u64> },
    /// The sender's requests in flight per worker, now.
    Load(Vec<(u64, u32)>),
    /// A session or conversation (its key's hash) is now bound to the worker.
    Binding {
        kind: super::BindingKind,
        key: u64,
        worker: u64,
    },
}

/// A batch being built.
#[derive(Debug)]
pub struct Batch {
    buf: Vec<u8>,
    records: usize,
}

impl Batch {
    pub fn new(replica: u64) -> Self {
        let mut buf = Vec::with_capacity(4096);
        buf.extend_from_slice(MAGIC);
        buf.push(VERSION);
        buf.extend_from_slice(&replica.to_le_bytes());
        Batch { buf, records: 0 }
    }

    pub fn push(&mut self, r: &Record) {
        self.records += 1;
        match r {
            Record::Prefix { worker, chain } => {
                let chain = &chain[..chain.len().min(MAX_CHAIN)];
                self.buf.push(1);
                self.buf.extend_from_slice(&worker.to_le_bytes());
                self.buf
                    .extend_from_slice(&(chain.len() as u16).to_le_bytes());
                for h in chain {
                    self.buf.extend_from_slice(&h.to_le_bytes());
                }
            }
            Record::Binding { kind, key, worker } => {
                self.buf.push(3);
                self.buf.push(match kind {
                    super::BindingKind::Session => 1,
                    super::BindingKind::Conversation => 2,
                });
                self.buf.extend_from_slice(&key.to_le_bytes());
                self.buf.extend_from_slice(&worker.to_le_bytes());
            }
            Record::Load(loads) => {
                let loads = &loads[..loads.len().min(u16::MAX as usize)];
                self.buf.push(2);
                self.buf
                    .extend_from_slice(&(loads.len() as u16).to_le_bytes());
                for (w, n) in loads {
                    self.buf.extend_from_slice(&w.to_le_bytes());
                    self.buf.extend_from_slice(&n.to_le_bytes());
                }
            }
        }
    }

    /// Records pushed so far.
    pub fn records(&self) -> usize {
        self.records
    }

    /// Bytes so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// The message so far.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    /// Empties the batch for the next message, keeping its buffer.
    pub fn clear(&mut self) {
        self.buf.truncate(HEADER);
        self.records = 0;
    }
}

/// A decoded message: the sender and its records; `Err` says why the bytes are not one.
pub fn decode(b: &[u8]) -> Result<(u64, Vec<Record>), &'static str> {
    let mut r = Reader(b);
    if r.take(4)? != MAGIC {
        return Err("not a fleet message");
    }
    if r.u8()? != VERSION {
        return Err("unknown fleet message version");
    }
    let replica = r.u64()?;
    let mut records = Vec::new();
    while !r.0.is_empty() {
        match r.u8()? {
            1 => {
                let worker = r.u64()?;
                let n = r.u16()? as usize;
                let chain = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
                records.push(Record::Prefix { worker, chain });
            }
            2 => {
                let n = r.u16()? as usize;
                let loads = (0..n)
                    .map(|_| Ok((r.u64()?, r.u32()?)))
                    .collect::<Result<_, &'static str>>()?;
                records.push(Record::Load(loads));
            }
            3 => {
                let kind = match r.u8()? {
                    1 => super::BindingKind::Session,
                    2 => super::BindingKind::Conversation,
                    _ => return Err("unknown binding map"),
                };
                let key = r.u64()?;
                let worker = r.u64()?;
                records.push(Record::Binding { kind, key, worker });
            }
            _ => return Err("unknown fleet record"),
        }
    }
    Ok((replica, records))
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("truncated fleet message");
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let mut b = Batch::new(42);
        let recs = vec![
            Record::Prefix {
                worker: 7,
                chain: vec![1, 2, 3],
            },
            Record::Load(vec![(7, 3), (9, 0)]),
            Record::Binding {
                kind: crate::fleet::BindingKind::Conversation,
                key: 5,
                worker: 9,
            },
            Record::Prefix {
                worker: 9,
                chain: vec![],
            },
        ];
        for r in &recs {
            b.push(r);
        }
        assert_eq!(b.records(), 4);
        let bytes = b.into_bytes();
        assert_eq!(decode(&bytes).unwrap(), (42, recs));
        for cut in 0..bytes.len() {
            // Every strict prefix is either a shorter valid message or refused.
            let _ = decode(&bytes[..cut]);
        }
        assert!(decode(b"CARF\x02xxxxxxxx").is_err());
        assert!(decode(b"hello").is_err());
        let mut bad = Batch::new(1).into_bytes();
        bad.push(9);
        assert!(decode(&bad).is_err());
    }
}
