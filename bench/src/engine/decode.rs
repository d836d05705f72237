//! The answer's text, as greedy decoding writes it: each output word is a function of
//! every word before it (the prompt's, then the answer's own), the way a real model's
//! greedy next token is a function of its context. So an answer continued from its
//! first k words (the prompt plus those words: vLLM's `continue_final_message` for
//! chat, the prompt plus the text for completions) goes on exactly as the
//! uninterrupted answer does, and two prompts get different answers.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::prompts::WORDS;

/// The state before any word.
const SEED: u64 = 0x6772_6565_6479; // "greedy"

/// The context so far, folded into one hash (a word at a time, so the state after a
/// prompt and k answer words equals the state after that prompt with the words in it).
#[derive(Debug, Clone, Copy)]
pub(super) struct Decoder(u64);

impl Decoder {
    /// The decoder once it has read `prompt` (whitespace-separated words, as the
    /// engine tokenizes).
    pub(super) fn after(prompt: &str) -> Self {
        let mut d = Decoder(SEED);
        for w in prompt.split_whitespace() {
            d.push(w);
        }
        d
    }

    fn push(&mut self, word: &str) {
        self.0 = xxh3_64_with_seed(word.as_bytes(), self.0);
    }

    /// The next output word (then part of the context).
    pub(super) fn next_word(&mut self) -> &'static str {
        let w = WORDS[(self.0 % WORDS.len() as u64) as usize];
        self.push(w);
        w
    }

    /// The next output token as streamed: the word with a leading space.
    pub(super) fn next_token(&mut self) -> String {
        format!(" {}", self.next_word())
    }
}

/// The first `n` tokens of the engine's answer to `prompt` (the prompt text: the chat
/// template's output for chat, see [`super::chat_prompt`]), concatenated as a client
/// reads them (each token one word with a leading space).
pub fn greedy_text(prompt: &str, n: u64) -> String {
    let mut d = Decoder::after(prompt);
    (0..n).map(|_| d.next_token()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_continued_from_its_first_words_is_the_whole_answer() {
        let prompt = "<|im_start|>user\ntell me a story\n<|im_end|>\n<|im_start|>assistant\n";
        let whole = greedy_text(prompt, 40);
        assert_eq!(whole.split_whitespace().count(), 40);
        let head = greedy_text(prompt, 15);
        let tail = greedy_text(&format!("{prompt}{head}"), 25);
        assert_eq!(format!("{head}{tail}"), whole);
        assert_ne!(greedy_text("another prompt", 40), whole);
    }
}
