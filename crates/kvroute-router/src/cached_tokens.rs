//! The router's predicted cache hits against the worker's own count.
//!
//! Engines can report how many prompt tokens they served from their prefix
//! cache, as `usage.prompt_tokens_details.cached_tokens`: vLLM with
//! `--enable-prompt-tokens-details` (and only when non-zero), SGLang with
//! `--enable-cache-report`, the simulated engine always (in a stream, in the
//! final usage chunk when `stream_options.include_usage` is set). When a
//! response carries it, the difference from the router's prediction is the
//! plainest measure of whether the router's picture of the caches is right,
//! and the evidence against a worker whose events claim more than it holds
//! ([`crate::fleet::claims`]).
//!
//! The usage sits at the end of a response, so the proxy keeps only the last
//! few frames it forwards (reference-counted, not copied) and scans their last
//! [`TAIL_BYTES`] once at the end: no JSON parse of the body, nothing on the
//! path of the frames themselves.

use std::collections::VecDeque;
use std::sync::{LazyLock, Mutex};

use bytes::Bytes;
use memchr::memmem;

use crate::fleet::booking::Booking;
use crate::metrics;

/// Bytes at the end of a response searched for the usage.
pub const TAIL_BYTES: usize = 4096;

/// Weight of one request in the rolling gap: about the last 100 that reported.
const GAP_WEIGHT: f64 = 0.01;

/// A response on its way to the client, checked against its prediction at the end.
pub struct Check {
    tail: Tail,
    prediction: Prediction,
}

impl Check {
    pub fn new(prediction: Prediction) -> Self {
        Self {
            tail: Tail::default(),
            prediction,
        }
    }

    /// A data frame was forwarded.
    pub fn push(&mut self, frame: &Bytes) {
        self.tail.push(frame);
    }

    /// The response ended: records the worker's count if the response had
    /// one, and judges with it the claim `booking`'s rank was routed on.
    pub fn finish(&self, booking: Option<&Booking>) {
        if let Some(actual) = self.tail.cached_tokens() {
            self.prediction.record(actual);
            if let Some(booking) = booking {
                booking.judge_claim(self.prediction.claimed_tokens, actual);
            }
        }
    }
}

/// The last frames of a response body, at least [`TAIL_BYTES`] of them. The
/// last is kept apart: most plain responses are one frame, searched where it
/// is, with no list and no copy.
#[derive(Default)]
struct Tail {
    last: Bytes,
    earlier: VecDeque<Bytes>,
    len: usize,
}

impl Tail {
    fn push(&mut self, frame: &Bytes) {
        let earlier = std::mem::replace(&mut self.last, frame.clone());
        if !earlier.is_empty() {
            self.earlier.push_back(earlier);
        }
        self.len += frame.len();
        while let Some(front) = self.earlier.front() {
            if self.len - front.len() < TAIL_BYTES {
                break;
            }
            self.len -= front.len();
            self.earlier.pop_front();
        }
    }

    /// The last `cached_tokens` count in the tail, if any.
    fn cached_tokens(&self) -> Option<u64> {
        let mut skip = self.len.saturating_sub(TAIL_BYTES);
        if self.earlier.is_empty() {
            return cached_tokens_in(&self.last[skip..]);
        }
        let mut tail = Vec::with_capacity(self.len.min(TAIL_BYTES));
        for frame in self.earlier.iter().chain([&self.last]) {
            let start = skip.min(frame.len());
            skip -= start;
            tail.extend_from_slice(&frame[start..]);
        }
        cached_tokens_in(&tail)
    }
}

/// Parses the number after the last `"cached_tokens":` in `text`.
fn cached_tokens_in(text: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"cached_tokens\"";
    // Made once: making a finder per search was most of a small response's check.
    static FINDER: LazyLock<memmem::Finder<'static>> = LazyLock::new(|| memmem::Finder::new(KEY));
    // The last one, found forwards from just after each: memchr's forward
    // search is vectorized, its reverse one is not.
    let mut at = FINDER.find(text)?;
    while let Some(next) = FINDER.find(&text[at + 1..]) {
        at += 1 + next;
    }
    let rest = &text[at + KEY.len()..];
    let rest = rest
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// What the router predicted for a request, to compare with the worker's report.
#[derive(Clone, Copy, Debug)]
pub struct Prediction {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// The part of `cached_tokens` the worker's own events claimed.
    pub claimed_tokens: u64,
}

impl Prediction {
    /// Records the worker's `actual` count beside the prediction. Requests the
    /// router could not tokenize predicted nothing and are left out.
    fn record(&self, actual: u64) {
        if self.prompt_tokens == 0 {
            return;
        }
        ::metrics::counter!(metrics::ACTUAL_CACHED_TOKENS).increment(actual);
        let error = self.cached_tokens as f64 - actual as f64;
        ::metrics::histogram!(metrics::CACHED_TOKENS_ERROR).record(error);
        let share = (error.abs() / self.prompt_tokens as f64).min(1.0);
        static GAP: Mutex<Option<f64>> = Mutex::new(None);
        let mut gap = GAP.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let value = match *gap {
            Some(g) => g + GAP_WEIGHT * (share - g),
            None => share,
        };
        *gap = Some(value);
        ::metrics::gauge!(metrics::CACHED_TOKENS_GAP).set(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_last_count_in_json_and_sse_tails() {
        let json =
            br#"{"usage":{"prompt_tokens":64,"prompt_tokens_details":{"cached_tokens": 48}}}"#;
        assert_eq!(cached_tokens_in(json), Some(48));
        let sse = b"data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n\
                    data: {\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens_in(sse), Some(32));
        assert_eq!(
            cached_tokens_in(br#"{"usage":{"prompt_tokens_details":null}}"#),
            None
        );
        assert_eq!(cached_tokens_in(br#"{"cached_tokens":null}"#), None);
        // The last key even where it overlaps the one before.
        assert_eq!(
            cached_tokens_in(br#"{"cached_tokens"cached_tokens": 5}"#),
            Some(5)
        );
    }

    #[test]
    fn a_one_frame_response_is_searched_in_its_last_bytes_only() {
        let mut tail = Tail::default();
        tail.push(&Bytes::from_static(br#"{"usage":{"cached_tokens":7}}"#));
        assert_eq!(tail.cached_tokens(), Some(7));
        let mut tail = Tail::default();
        let count_then_filler = format!("{{\"cached_tokens\":7}}{}", " ".repeat(TAIL_BYTES));
        tail.push(&Bytes::from(count_then_filler));
        assert_eq!(tail.cached_tokens(), None, "older than the tail");
    }

    #[test]
    fn the_tail_keeps_enough_frames_and_drops_older_ones() {
        let mut tail = Tail::default();
        tail.push(&Bytes::from(format!(
            "{{\"cached_tokens\":1}}{}",
            " ".repeat(TAIL_BYTES)
        )));
        for _ in 0..100 {
            tail.push(&Bytes::from_static(b"data: {\"choices\":[]}\n\n"));
        }
        assert_eq!(tail.cached_tokens(), None, "older than the tail");
        // A count split across two frames is found.
        tail.push(&Bytes::from_static(b"data: {\"usage\":{\"cached_"));
        tail.push(&Bytes::from_static(b"tokens\":96}}\n\ndata: [DONE]\n\n"));
        assert_eq!(tail.cached_tokens(), Some(96));
        assert!(tail.earlier.len() < 200);
    }
}
