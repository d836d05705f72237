//! Chained hashes of fixed chunks of a prompt: one pass over the prompt gives both its
//! digest and the chunk hashes that router replicas share their prefix records by
//! (`crate::fleet`), so a request's text is hashed once, at extraction.
//!
//! Chunk `i` is the bytes `[i·CHUNK_BYTES, (i+1)·CHUNK_BYTES)`; its hash `h[i]` is
//! [`link`] of `h[i-1]` (0 before the first) and the chunk, so equal hashes mean equal
//! prefixes. A digest is [`link`] of the last whole chunk's hash and the partial tail
//! (shorter than a chunk, possibly empty).

/// Bytes of prompt per hashed chunk: the granularity of a match shared between router
/// replicas.
pub const CHUNK_BYTES: usize = 128;

/// One step of the chain: the hash of `chunk` after the chain's hash `prev` — xxh3-64
/// of the chunk, unseeded (a seeded xxh3 costs ~40 % more per 128-byte chunk), folded
/// into `prev` by a step that is a bijection of the chunk's hash for a given `prev`
/// (xor, odd multiply, xor-shift) and not symmetric in the two (the rotation), so
/// reordered chunks do not collide.
#[inline]
pub fn link(prev: u64, chunk: &[u8]) -> u64 {
    let x = (prev.rotate_left(29) ^ xxhash_rust::xxh3::xxh3_64(chunk))
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 32)
}

/// The chained hashes of `text`'s whole [`CHUNK_BYTES`] chunks (the partial tail is not
/// hashed).
pub fn chain(text: &[u8]) -> impl Iterator<Item = u64> + '_ {
    // `as_chunks`: each chunk's length is known at compile time, so xxh3's length
    // dispatch folds away.
    text.as_chunks::<CHUNK_BYTES>()
        .0
        .iter()
        .scan(0u64, |prev, c| {
            *prev = link(*prev, c);
            Some(*prev)
        })
}

/// Appends to `chain` (the hashes of the chunks before `rest`) those of `rest`'s whole
/// chunks.
pub fn extend(chain: &mut Vec<u64>, rest: &[u8]) {
    let mut prev = chain.last().copied().unwrap_or(0);
    chain.extend(rest.as_chunks::<CHUNK_BYTES>().0.iter().map(|c| {
        prev = link(prev, c);
        prev
    }));
}

/// The digest of `bytes`: as [`Chunker::digest`] after one `update` with all of them.
pub fn digest(bytes: &[u8]) -> u64 {
    let whole = bytes.len() / CHUNK_BYTES * CHUNK_BYTES;
    let prev = chain(&bytes[..whole]).last().unwrap_or(0);
    link(prev, &bytes[whole..])
}

/// Hashes a prompt fed in pieces of any size, chunk by chunk, keeping the hashes of the
/// chunks that end within the first `keep` bytes (the routing text's budget).
#[derive(Debug)]
pub struct Chunker {
    /// Hashes of the whole chunks within `keep` bytes.
    hashes: Vec<u64>,
    /// How many hashes are kept at most (`keep / CHUNK_BYTES`).
    kept: usize,
    /// The last whole chunk's hash (0 before the first).
    prev: u64,
    /// Bytes fed so far.
    fed: usize,
    /// The bytes after the last whole chunk (`fed % CHUNK_BYTES` of them).
    carry: [u8; CHUNK_BYTES],
}

impl Chunker {
    /// A chunker keeping the hashes of chunks within `keep` bytes; `expect` (bytes) sizes
    /// the list of kept hashes up front (the body's length, say).
    pub fn new(keep: usize, expect: usize) -> Self {
        Chunker {
            hashes: Vec::with_capacity(keep.min(expect) / CHUNK_BYTES),
            kept: keep / CHUNK_BYTES,
            prev: 0,
            fed: 0,
            carry: [0; CHUNK_BYTES],
        }
    }

    /// The next whole chunk's hash, `h` (kept while within `keep`).
    fn push(&mut self, h: u64) {
        self.prev = h;
        if self.hashes.len() < self.kept {
            self.hashes.push(h);
        }
    }

    /// Feeds the next bytes of the prompt. Whole chunks are hashed where they lie; only
    /// a chunk split between two calls is copied (at most `CHUNK_BYTES - 1` bytes).
    pub fn update(&mut self, mut bytes: &[u8]) {
        let held = self.fed % CHUNK_BYTES;
        self.fed += bytes.len();
        if held > 0 {
            let take = (CHUNK_BYTES - held).min(bytes.len());
            self.carry[held..held + take].copy_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if held + take < CHUNK_BYTES {
                return;
            }
            let h = link(self.prev, &self.carry);
            self.push(h);
        }
        let (whole, tail) = bytes.as_chunks::<CHUNK_BYTES>();
        let mut whole = whole.iter();
        let mut prev = self.prev;
        // Kept hashes are written in one `extend` (one capacity check), the rest only
        // chained.
        let room = self.kept.saturating_sub(self.hashes.len());
        self.hashes.extend(whole.by_ref().take(room).map(|c| {
            prev = link(prev, c);
            prev
        }));
        for c in whole {
            prev = link(prev, c);
        }
        self.prev = prev;
        self.carry[..tail.len()].copy_from_slice(tail);
    }

    /// The digest of everything fed so far: [`link`] of the last whole chunk's hash and
    /// the tail. Equal for equal byte sequences, however they were split.
    pub fn digest(&self) -> u64 {
        link(self.prev, &self.carry[..self.fed % CHUNK_BYTES])
    }

    /// The kept hashes, cut to the whole chunks of the first `len` bytes (`len` ≤
    /// `keep`: the routing text's length).
    pub fn into_chain(mut self, len: usize) -> Vec<u64> {
        self.hashes.truncate(len / CHUNK_BYTES);
        self.hashes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_is_prefix_closed_and_ignores_the_partial_tail() {
        let a = vec![b'a'; CHUNK_BYTES * 3 + 5];
        let mut b = a.clone();
        b[CHUNK_BYTES * 2 + 1] = b'b';
        let ha: Vec<u64> = chain(&a).collect();
        let hb: Vec<u64> = chain(&b).collect();
        assert_eq!(ha.len(), 3);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        assert_ne!(ha[0], ha[1], "each chunk's hash folds in the one before");
        // Order matters: the same chunks reordered hash apart.
        let (x, y) = (vec![b'x'; CHUNK_BYTES], vec![b'y'; CHUNK_BYTES]);
        let xy: Vec<u64> = chain(&[x.clone(), y.clone()].concat()).collect();
        let yx: Vec<u64> = chain(&[y, x].concat()).collect();
        assert_ne!(xy[1], yx[1]);
        assert_eq!(chain(&a[..CHUNK_BYTES - 1]).count(), 0);
    }

    #[test]
    fn a_prompt_fed_in_any_pieces_chains_and_digests_as_one() {
        let text: Vec<u8> = (0..CHUNK_BYTES * 7 + 45)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let whole: Vec<u64> = chain(&text).collect();
        for piece in [1, 3, 127, 128, 129, 300, text.len()] {
            let mut c = Chunker::new(CHUNK_BYTES * 4 + 10, text.len());
            for p in text.chunks(piece) {
                c.update(p);
            }
            assert_eq!(c.digest(), digest(&text), "pieces of {piece}");
            // Only the chunks within `keep` are kept, cut to the text's length.
            assert_eq!(
                c.into_chain(CHUNK_BYTES * 4 + 10),
                whole[..4],
                "pieces of {piece}"
            );
        }
        let mut c = Chunker::new(usize::MAX, 0);
        c.update(&text);
        assert_eq!(c.into_chain(CHUNK_BYTES * 2 + 1), whole[..2]);
    }

    #[test]
    fn digests_tell_apart_what_differs_anywhere_or_in_length() {
        let a = vec![b'a'; CHUNK_BYTES * 2];
        let mut b = a.clone();
        b[CHUNK_BYTES * 2 - 1] = b'b';
        assert_ne!(digest(&a), digest(&b));
        assert_ne!(digest(&a), digest(&a[..CHUNK_BYTES * 2 - 1]));
        assert_ne!(digest(&a[..CHUNK_BYTES]), digest(&a[..CHUNK_BYTES + 1]));
        assert_ne!(digest(b""), digest(b"\0"));
    }
}
