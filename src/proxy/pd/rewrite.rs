//! The usage a disaggregated request's client receives reports the prefill leg's
//! `cached_tokens` (as vLLM's own proxy, vllm-router and llm-d do): the decode engine
//! counts the KV it read from the prefill worker as cached, which says nothing about the
//! prefix cache. [`CachedTokens`] rewrites that one number as the decode answer passes,
//! frame by frame (nothing held back); a number cut between two reads of the engine's
//! answer is left as the engine wrote it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// See the module docs. The body's length may change: its size is unknown.
pub struct CachedTokens<B> {
    inner: B,
    value: u64,
    /// `"usage"` has passed (the count follows it).
    in_usage: bool,
    done: bool,
}

impl<B> CachedTokens<B> {
    /// `inner` with its usage's `cached_tokens` reported as `value`.
    pub fn new(inner: B, value: u64) -> Self {
        CachedTokens {
            inner,
            value,
            in_usage: false,
            done: false,
        }
    }

    fn pass(&mut self, data: Bytes) -> Bytes {
        if self.done {
            return data;
        }
        let from = match find(&data, b"\"usage\"") {
            Some(at) => {
                self.in_usage = true;
                at
            }
            None if self.in_usage => 0,
            None => return data,
        };
        match replace_count(&data[from..], self.value) {
            Some((range, digits)) => {
                self.done = true;
                let (start, end) = (from + range.start, from + range.end);
                let mut out = Vec::with_capacity(data.len() + digits.len());
                out.extend_from_slice(&data[..start]);
                out.extend_from_slice(digits.as_bytes());
                out.extend_from_slice(&data[end..]);
                Bytes::from(out)
            }
            None => data,
        }
    }
}

/// Where `needle` first is in `hay`.
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The range of the number after the first `"cached_tokens":` in `data`, and `value`
/// written; `None` when there is none (or it is `null`, or cut at the end of `data`).
fn replace_count(data: &[u8], value: u64) -> Option<(std::ops::Range<usize>, String)> {
    let key = b"\"cached_tokens\"";
    let mut i = find(data, key)? + key.len();
    let skip = |i: &mut usize| {
        while data.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    skip(&mut i);
    (data.get(i) == Some(&b':')).then_some(())?;
    i += 1;
    skip(&mut i);
    let start = i;
    while data.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    (i > start && i < data.len()).then(|| (start..i, value.to_string()))
}

impl<B: Body<Data = Bytes> + Unpin> Body for CachedTokens<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match frame.into_data() {
                    Ok(data) => Frame::data(this.pass(data)),
                    Err(other) => other,
                };
                Poll::Ready(Some(Ok(frame)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pass(frames: &[&str], value: u64) -> String {
        let mut r = CachedTokens::new((), value);
        frames
            .iter()
            .map(|f| String::from_utf8(r.pass(Bytes::from(f.to_string())).to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn the_usage_count_is_rewritten_once_wherever_the_answer_is_cut() {
        let json = r#"{"choices":[{"text":"cached_tokens"}],"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens": 900}}}"#;
        let want = json.replace(r#""cached_tokens": 900"#, r#""cached_tokens": 64"#);
        assert_eq!(pass(&[json], 64), want);
        let (a, b) = json.split_at(json.find("prompt_tokens_details").unwrap());
        assert_eq!(pass(&[a, b], 64), want, "the count in a later read");
        // SSE: only the usage chunk's count.
        let sse = [
            "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":5}}}\n\ndata: [DONE]\n\n",
        ];
        assert_eq!(
            pass(&sse, 0),
            sse.concat()
                .replace("cached_tokens\":5", "cached_tokens\":0")
        );
        // Nothing to rewrite: no details, a null count.
        for same in [
            r#"{"usage":{"prompt_tokens":5}}"#,
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}"#,
        ] {
            assert_eq!(pass(&[same], 3), same);
        }
    }
}
