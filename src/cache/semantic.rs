//! The semantic lookup: the conversation text embedded through an OpenAI-compatible
//! `/v1/embeddings` endpoint, compared by cosine similarity with a partition's newest
//! stored answers.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use serde::Deserialize;

use super::store::Candidate;
use crate::config::SemanticConfig;
use crate::upstream::Upstream;

/// Longest one embeddings call may take; past it the request goes on as an exact miss.
pub const EMBED_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest embeddings answer read, in bytes.
const MAX_ANSWER_BYTES: usize = 8 << 20;
/// Longest vector accepted (the largest embedding models give 4096 dimensions).
const MAX_DIMENSIONS: usize = 16_384;

/// Why an embeddings call gave no vector.
#[derive(Debug, Clone)]
pub struct EmbedError {
    pub message: String,
    /// The endpoint is down, slow or failing (not just this request): lookups pause.
    pub unavailable: bool,
}

/// Calls the embeddings endpoint.
pub struct Embedder {
    cfg: SemanticConfig,
    upstream: Upstream,
    /// The backend key, when the endpoint is one of the workers (same scheme and
    /// authority): another host never sees it.
    bearer: Option<HeaderValue>,
}

#[derive(Deserialize)]
struct Answer {
    data: Vec<Datum>,
}

#[derive(Deserialize)]
struct Datum {
    embedding: Vec<f32>,
}

impl Embedder {
    pub fn new(cfg: SemanticConfig, upstream: Upstream, bearer: Option<HeaderValue>) -> Self {
        Embedder {
            cfg,
            upstream,
            bearer,
        }
    }

    /// Least similarity that counts as a hit.
    pub fn threshold(&self) -> f32 {
        self.cfg.threshold
    }

    /// How many candidates a lookup compares.
    pub fn max_candidates(&self) -> usize {
        self.cfg.max_candidates
    }

    /// The unit-length embedding of `text`; `Err` says why there is none (endpoint
    /// down, not 200, not an embeddings answer, zero or non-finite vector).
    pub async fn embed(&self, text: &str) -> Result<Arc<[f32]>, EmbedError> {
        let body = serde_json::json!({"model": self.cfg.model, "input": text}).to_string();
        let (status, answer) = self
            .upstream
            .post_json(
                &self.cfg.embeddings_url,
                Bytes::from(body),
                self.bearer.as_ref(),
                EMBED_TIMEOUT,
                MAX_ANSWER_BYTES,
            )
            .await
            .map_err(|e| EmbedError {
                message: crate::error::describe(&e),
                unavailable: true,
            })?;
        let bad = |message: String| EmbedError {
            message,
            // A 5xx is the endpoint's state; a 4xx or a bad answer is this request's.
            unavailable: status.is_server_error(),
        };
        if !status.is_success() {
            return Err(bad(format!("embeddings endpoint answered {status}")));
        }
        let a: Answer = serde_json::from_slice(&answer)
            .map_err(|e| bad(format!("embeddings answer unreadable: {e}")))?;
        let v = a
            .data
            .into_iter()
            .next()
            .ok_or_else(|| bad("embeddings answer has no data".into()))?
            .embedding;
        unit(v).ok_or_else(|| bad("embedding is empty, too long, zero or not finite".into()))
    }
}

/// `v` scaled to length 1; `None` for an empty, oversized, zero or non-finite vector.
pub fn unit(mut v: Vec<f32>) -> Option<Arc<[f32]>> {
    if v.is_empty() || v.len() > MAX_DIMENSIONS || !v.iter().all(|x| x.is_finite()) {
        return None;
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if !(norm.is_finite() && norm > 0.0) {
        return None;
    }
    v.iter_mut().for_each(|x| *x /= norm);
    Some(Arc::from(v))
}

/// The candidate most similar to `v` (cosine of unit vectors = dot product) at or above
/// `threshold`, with its similarity. Candidates of another dimension never match.
pub fn best<'a>(
    candidates: &'a [Candidate],
    v: &[f32],
    threshold: f32,
) -> Option<(&'a Candidate, f32)> {
    candidates
        .iter()
        .filter(|c| c.vector.len() == v.len())
        .map(|c| (c, c.vector.iter().zip(v).map(|(a, b)| a * b).sum::<f32>()))
        .filter(|(_, s)| *s >= threshold)
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_refuses_what_cannot_be_compared() {
        assert!(unit(vec![]).is_none());
        assert!(unit(vec![0.0, 0.0]).is_none());
        assert!(unit(vec![f32::NAN, 1.0]).is_none());
        let u = unit(vec![3.0, 4.0]).unwrap();
        assert!((u[0] - 0.6).abs() < 1e-6 && (u[1] - 0.8).abs() < 1e-6);
    }

    #[test]
    fn best_is_the_closest_above_the_threshold() {
        let c = |k: u8, v: Vec<f32>| Candidate {
            key: [k; 32],
            vector: unit(v).unwrap(),
        };
        let cands = vec![
            c(1, vec![1.0, 0.0]),
            c(2, vec![0.9, 0.1]),
            c(3, vec![1.0, 0.0, 0.0]),
        ];
        let q = unit(vec![0.95, 0.08]).unwrap();
        let (hit, sim) = best(&cands, &q, 0.9).unwrap();
        assert_eq!(hit.key[0], 2);
        assert!(sim > 0.99);
        let far = unit(vec![0.0, 1.0]).unwrap();
        assert!(best(&cands, &far, 0.5).is_none());
    }
}
