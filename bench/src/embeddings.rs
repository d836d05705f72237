//! Deterministic text embeddings for the simulated engine's `POST /v1/embeddings`
//! (OpenAI shape), with no model behind them.
//!
//! A vector is **feature hashing** of the text into [`EMBEDDING_DIM`] (256) `f32`
//! dimensions, L2-normalised (length 1, so the dot product of two vectors is their
//! cosine similarity):
//! - **words**: maximal runs of alphanumeric characters, lowercased ("Hello, World!"
//!   is `hello`, `world`); a text with none (e.g. "?!") uses its whitespace-separated
//!   pieces instead.
//! - **features**: every word (weight [`WORD_WEIGHT`]) and every character trigram
//!   of the word padded as `<word>` (weight [`TRIGRAM_WEIGHT`] each), so a changed
//!   word costs little and "cache" is close to "caches".
//! - **hashing**: xxh3 (one seed for words, another for trigrams) picks the
//!   dimension (hash mod 256) and the sign (top bit), so collisions cancel out on
//!   average instead of making unrelated texts look alike.
//!
//! What that gives: equal texts up to case and punctuation have equal vectors; two
//! ~30-word texts differing in one word have cosine above 0.92; unrelated sentences
//! have cosine well below 0.5. Stable across engines, runs and machines, like the
//! engine's [`token_id`](crate::engine::token_id).

use serde_json::{Map, Value, json};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Dimensions of every vector [`embed`] returns.
pub const EMBEDDING_DIM: usize = 256;

/// Weight of a whole-word feature, before normalisation.
pub const WORD_WEIGHT: f32 = 1.0;

/// Weight of one character-trigram feature, before normalisation.
pub const TRIGRAM_WEIGHT: f32 = 0.25;

/// Hash seed of word features.
const WORD_SEED: u64 = 0x656d_6265_6421_0001;

/// Hash seed of trigram features (distinct from [`WORD_SEED`], so the word "abc"
/// and the trigram "abc" land independently).
const TRIGRAM_SEED: u64 = 0x656d_6265_6421_0003;

/// The embedding of `text`: [`EMBEDDING_DIM`] values, L2 norm 1 (see the module
/// docs). An empty text gives the fixed unit vector of the empty string.
pub fn embed(text: &str) -> Vec<f32> {
    let mut v = vec![0.0f32; EMBEDDING_DIM];
    for word in words(text) {
        add_feature(&mut v, word.as_bytes(), WORD_SEED, WORD_WEIGHT);
        let padded: Vec<char> = format!("<{word}>").chars().collect();
        for tri in padded.windows(3) {
            let tri: String = tri.iter().collect();
            add_feature(&mut v, tri.as_bytes(), TRIGRAM_SEED, TRIGRAM_WEIGHT);
        }
    }
    normalize(&mut v, text);
    v
}

/// Cosine similarity of two vectors (their dot product over both norms; 0 when
/// either is all zeros). For [`embed`]'s unit vectors it is the dot product.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let (na, nb) = (norm(a), norm(b));
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

/// Lowercased alphanumeric runs of `text`, or its whitespace-separated pieces when
/// it has none.
fn words(text: &str) -> Vec<String> {
    let alnum: Vec<String> = text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    if alnum.is_empty() {
        text.split_whitespace().map(str::to_lowercase).collect()
    } else {
        alnum
    }
}

/// Adds `weight` × ±1 to the dimension `feature` hashes to.
fn add_feature(v: &mut [f32], feature: &[u8], seed: u64, weight: f32) {
    let h = xxh3_64_with_seed(feature, seed);
    let sign = if h >> 63 == 0 { 1.0 } else { -1.0 };
    v[(h % EMBEDDING_DIM as u64) as usize] += sign * weight;
}

/// Scales `v` to length 1. A vector whose features all cancelled (or that has
/// none) becomes the unit vector of `text`'s whole-text hash, so every embedding
/// has norm 1.
fn normalize(v: &mut [f32], text: &str) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x /= norm);
    } else {
        add_feature(v, text.as_bytes(), WORD_SEED ^ TRIGRAM_SEED, 1.0);
    }
}

/// A `POST /v1/embeddings` request after validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmbeddingRequest {
    /// The request's `model`, when it names one.
    pub model: Option<String>,
    /// The texts to embed, in order (`input` as a string is one text).
    pub inputs: Vec<String>,
}

/// Validates an embeddings body: `input` a non-empty string or a non-empty array
/// of them (none blank), `model` a string if present, `encoding_format` absent,
/// null or `"float"`. The error is the message of a 400 response.
pub fn parse_request(body: &[u8]) -> Result<EmbeddingRequest, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not valid JSON: {e}"))?;
    let obj = v.as_object().ok_or("request body must be a JSON object")?;
    check_encoding_format(obj)?;
    let model = match present(obj, "model") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("model must be a string".into()),
    };
    Ok(EmbeddingRequest {
        model,
        inputs: inputs(present(obj, "input"))?,
    })
}

/// `obj[key]`, treating JSON null as absent.
fn present<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

/// Only `"float"` vectors are served (OpenAI's default).
fn check_encoding_format(obj: &Map<String, Value>) -> Result<(), String> {
    match present(obj, "encoding_format") {
        None => Ok(()),
        Some(Value::String(s)) if s == "float" => Ok(()),
        Some(other) => Err(format!(
            "encoding_format {other} is not supported: use \"float\""
        )),
    }
}

/// The texts of `input`: a string, or an array of strings.
fn inputs(input: Option<&Value>) -> Result<Vec<String>, String> {
    const SHAPE: &str = "input must be a string or an array of strings";
    let texts: Vec<String> = match input {
        None => return Err(format!("input is required: {SHAPE}")),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.is_empty() => {
            return Err("input must not be empty".into());
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| x.as_str().map(str::to_owned).ok_or(SHAPE))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(SHAPE.into()),
    };
    match texts
        .iter()
        .position(|t| t.split_whitespace().next().is_none())
    {
        Some(i) => Err(format!("input[{i}] must not be empty")),
        None => Ok(texts),
    }
}

/// Prompt tokens of one text, in the engine's tokenizer (whitespace-separated
/// words, as [`crate::engine::tokenize_text`] counts them).
pub fn prompt_tokens(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// The OpenAI response body: `{"object":"list","data":[{"object":"embedding",
/// "index","embedding"}],"model","usage":{"prompt_tokens","total_tokens"}}`, with
/// the request's model or, when it names none, `served_model`.
pub fn response_body(req: &EmbeddingRequest, served_model: &str) -> Value {
    let data: Vec<Value> = req
        .inputs
        .iter()
        .enumerate()
        .map(|(i, text)| json!({"object": "embedding", "index": i, "embedding": embed(text)}))
        .collect();
    let tokens: u64 = req.inputs.iter().map(|t| prompt_tokens(t)).sum();
    json!({
        "object": "list",
        "data": data,
        "model": req.model.as_deref().unwrap_or(served_model),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 30 words.
    const FARM: &str = "The quick brown fox jumps over the lazy dog while the old farmer \
                        watches from his wooden porch and slowly drinks a hot cup of \
                        coffee every morning before sunrise";

    fn norm(v: &[f32]) -> f32 {
        v.iter().map(|x| x * x).sum::<f32>().sqrt()
    }

    #[test]
    fn vectors_are_unit_length_fixed_size_and_deterministic() {
        assert_eq!(FARM.split_whitespace().count(), 30);
        for text in [FARM, "a", "?!", "  x  ", ""] {
            let v = embed(text);
            assert_eq!(v.len(), EMBEDDING_DIM);
            assert!((norm(&v) - 1.0).abs() < 1e-5, "{text:?}: norm {}", norm(&v));
            assert_eq!(v, embed(text), "{text:?}");
        }
        // Case and punctuation do not matter.
        assert_eq!(
            embed("What is the capital of France?"),
            embed("what is the capital of france")
        );
    }

    #[test]
    fn one_word_changed_in_thirty_stays_above_0_92() {
        let pairs = [
            ("coffee", "tea"),
            ("fox", "cat"),
            ("sunrise", "noon"),
            ("farmer", "fisherman"),
        ];
        for (from, to) in pairs {
            let other = FARM.replacen(from, to, 1);
            assert_ne!(other, FARM);
            let c = cosine(&embed(FARM), &embed(&other));
            assert!(c > 0.92, "{from} -> {to}: cosine {c}");
            assert!(c < 1.0, "{from} -> {to}: cosine {c}");
        }
    }

    #[test]
    fn unrelated_sentences_stay_below_0_5() {
        let texts = [
            FARM,
            "How do I reset the admin password of my home wifi router after forgetting it?",
            "Photosynthesis converts sunlight, water and carbon dioxide into glucose and oxygen.",
            "The stock market fell sharply on Tuesday as investors worried about interest rates.",
            "Write a Python function that returns the nth Fibonacci number using memoization.",
        ];
        for (i, a) in texts.iter().enumerate() {
            for b in &texts[i + 1..] {
                let c = cosine(&embed(a), &embed(b));
                assert!(c < 0.5, "cosine {c} of\n  {a}\n  {b}");
            }
        }
    }

    #[test]
    fn cosine_of_zero_vector_is_zero() {
        assert_eq!(cosine(&[0.0; 3], &[1.0, 0.0, 0.0]), 0.0);
        assert!((cosine(&[1.0, 1.0], &[2.0, 2.0]) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn response_has_the_openai_shape() {
        let req = parse_request(br#"{"model": "emb", "input": ["hello world", "bye"]}"#).unwrap();
        let v = response_body(&req, "m");
        assert_eq!(v["object"], "list");
        assert_eq!(v["model"], "emb");
        assert_eq!(v["usage"], json!({"prompt_tokens": 3, "total_tokens": 3}));
        let data = v["data"].as_array().unwrap();
        assert_eq!(data.len(), 2);
        for (i, d) in data.iter().enumerate() {
            assert_eq!(d["object"], "embedding");
            assert_eq!(d["index"], i);
            let e: Vec<f32> = serde_json::from_value(d["embedding"].clone()).unwrap();
            assert_eq!(e, embed(&req.inputs[i]));
        }
        // A single string is one input; no model falls back to the served one.
        let one = parse_request(br#"{"input": "hi", "encoding_format": "float"}"#).unwrap();
        assert_eq!(one.inputs, ["hi"]);
        assert_eq!(response_body(&one, "m")["model"], "m");
        assert!(parse_request(br#"{"input": "hi", "encoding_format": null}"#).is_ok());
    }

    #[test]
    fn bad_requests_are_rejected_with_messages() {
        let bad = [
            ("not json", "valid JSON"),
            ("[]", "JSON object"),
            (r#"{"model": "m"}"#, "input is required"),
            (r#"{"input": null}"#, "input is required"),
            (r#"{"input": 5}"#, "string or an array"),
            (r#"{"input": [1, 2]}"#, "string or an array"),
            (r#"{"input": ["a", {}]}"#, "string or an array"),
            (r#"{"input": []}"#, "must not be empty"),
            (r#"{"input": ["a", " "]}"#, "input[1] must not be empty"),
            (r#"{"input": ""}"#, "must not be empty"),
            (r#"{"input": "a", "model": 3}"#, "model must be a string"),
            (
                r#"{"input": "a", "encoding_format": "base64"}"#,
                "encoding_format",
            ),
            (r#"{"input": "a", "encoding_format": 1}"#, "encoding_format"),
        ];
        for (body, want) in bad {
            let err = parse_request(body.as_bytes()).unwrap_err();
            assert!(err.contains(want), "{body}: {err}");
        }
    }
}
