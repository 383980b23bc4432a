//! cl100k_base's pre-tokenizer, by hand, for ASCII text.
//!
//! tiktoken splits text with a regular expression before BPE; for cl100k_base
//! it is
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N}{1,3}
//!   | ?[^\s\p{L}\p{N}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
//! ```
//!
//! with the alternatives tried in that order at each position. Running it on a
//! regex engine is half the cost of encoding a prompt once BPE results are
//! cached (see the `pieces` module), because the engine is general. For ASCII
//! the classes are simple (`\p{L}` is `[A-Za-z]`, `\p{N}` is `[0-9]`, `\s` is
//! `[\t\n\x0B\x0C\r ]`), so [`ascii_piece_end`] decides the piece with a few
//! byte comparisons. Whenever a byte it must classify is not ASCII (it could
//! be a letter, a digit or a space of another script) it gives up and the
//! caller asks the regex for that one piece; the property tests compare the
//! result with tiktoken-rs on text that mixes both.

/// Where the piece of `text` starting at `start` ends, as `bpe`'s split
/// pattern cuts it: by [`ascii_piece_end`] where that decides and `by_hand`
/// (cl100k_base only), else by `bpe`'s regex. `start` must be on a char
/// boundary and less than `text.len()`. (The patterns look at nothing before
/// a piece, so the first piece of `text[start..]` is the piece at `start`.)
#[inline]
pub(crate) fn piece_end(
    bpe: &bpe_openai::Tokenizer,
    by_hand: bool,
    text: &str,
    start: usize,
) -> usize {
    if by_hand {
        let bytes = text.as_bytes();
        // Most pieces are a word after a space, or a word: decided here,
        // inline; the other shapes in [`ascii_piece_end`].
        let first = bytes[start];
        let letters_from = if first.is_ascii_alphabetic() {
            Some(start + 1)
        } else if first == b' ' && bytes.get(start + 1).is_some_and(u8::is_ascii_alphabetic) {
            Some(start + 2)
        } else {
            None
        };
        let end = match letters_from {
            Some(from) => letters_end(bytes, from),
            None => ascii_piece_end(bytes, start),
        };
        if let Some(end) = end {
            return end;
        }
    }
    // A non-empty text has a first piece; the fallback only guards the loop.
    bpe.split(&text[start..])
        .next()
        .map_or(text.len(), |piece| start + piece.len())
}

/// Where the cl100k_base piece starting at `start` ends, or `None` if that
/// depends on a non-ASCII byte. `start` must be less than `text.len()`.
#[inline(never)]
pub(crate) fn ascii_piece_end(text: &[u8], start: usize) -> Option<usize> {
    let first = text[start];
    let next = text.get(start + 1).copied();
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if first == b'\'' {
        let lower = |i: usize| text.get(i).map(u8::to_ascii_lowercase);
        match lower(start + 1) {
            Some(b's' | b't' | b'm' | b'd') => return Some(start + 2),
            Some(b'r' | b'v') if lower(start + 2) == Some(b'e') => return Some(start + 3),
            Some(b'l') if lower(start + 2) == Some(b'l') => return Some(start + 3),
            _ => {}
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if first.is_ascii_alphabetic() {
        return letters_end(text, start + 1);
    }
    if !first.is_ascii() {
        return None;
    }
    let optional_prefix = first != b'\r' && first != b'\n' && !first.is_ascii_digit();
    if optional_prefix {
        match next {
            Some(byte) if !byte.is_ascii() => return None,
            Some(byte) if byte.is_ascii_alphabetic() => return letters_end(text, start + 2),
            _ => {}
        }
    }
    // \p{N}{1,3}
    if first.is_ascii_digit() {
        let mut end = start + 1;
        while end < text.len() && end < start + 3 {
            match text[end] {
                byte if byte.is_ascii_digit() => end += 1,
                byte if !byte.is_ascii() => return None,
                _ => break,
            }
        }
        return Some(end);
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    let symbols_start = if first == b' ' { start + 1 } else { start };
    let mut end = symbols_start;
    while let Some(&byte) = text.get(end) {
        if !byte.is_ascii() {
            return None;
        }
        if is_space(byte) || byte.is_ascii_alphanumeric() {
            break;
        }
        end += 1;
    }
    if end > symbols_start {
        while matches!(text.get(end), Some(b'\r' | b'\n')) {
            end += 1;
        }
        return Some(end);
    }
    // Only whitespace is left: `first` is a space (anything else matched above).
    let mut run_end = start;
    let mut last_newline = None;
    while let Some(&byte) = text.get(run_end) {
        if !byte.is_ascii() {
            return None;
        }
        if !is_space(byte) {
            break;
        }
        if byte == b'\r' || byte == b'\n' {
            last_newline = Some(run_end);
        }
        run_end += 1;
    }
    // \s*[\r\n]+ : up to the run's last line break.
    if let Some(newline) = last_newline {
        return Some(newline + 1);
    }
    // \s+(?!\S) : the whole run at the end of the text, else all but its last
    // space (which then starts the next piece); \s+ : a single space.
    if run_end == text.len() || run_end - start == 1 {
        Some(run_end)
    } else {
        Some(run_end - 1)
    }
}

/// The end of a run of ASCII letters from `from`, if no non-ASCII byte (maybe
/// a letter) follows it. Eight bytes at a time where eight are left: words
/// are most of a text, and a byte loop was most of the split's cost.
#[inline]
fn letters_end(text: &[u8], from: usize) -> Option<usize> {
    let mut end = from;
    while let Some(&bytes) = text.get(end..).and_then(|rest| rest.first_chunk::<8>()) {
        let others = !ascii_letters(u64::from_le_bytes(bytes)) & HIGH_BITS;
        if others == 0 {
            end += 8;
            continue;
        }
        end += others.trailing_zeros() as usize / 8;
        return text[end].is_ascii().then_some(end);
    }
    while let Some(&byte) = text.get(end) {
        if byte.is_ascii_alphabetic() {
            end += 1;
        } else if byte.is_ascii() {
            break;
        } else {
            return None;
        }
    }
    Some(end)
}

/// The high bit of each byte of a word.
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// The bytes of `word` that are ASCII letters, as their high bits (SWAR: every
/// byte is compared at once, and no sum carries into the next byte because
/// each is at most 0x7F + 0x1F).
fn ascii_letters(word: u64) -> u64 {
    let ones = |byte: u64| byte * 0x0101_0101_0101_0101;
    let ascii = !word & HIGH_BITS;
    // ASCII letters are the bytes whose lower case is in b'a'..=b'z'.
    let lower = (word | ones(0x20)) & !HIGH_BITS;
    let at_least_a = lower + ones(0x80 - u64::from(b'a'));
    let above_z = lower + ones(0x80 - u64::from(b'z') - 1);
    at_least_a & !above_z & ascii
}

/// `\s` within ASCII: tab, line feed, vertical tab, form feed, carriage return, space.
fn is_space(byte: u8) -> bool {
    matches!(byte, b'\t'..=b'\r' | b' ')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        let mut pieces = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let end = ascii_piece_end(text.as_bytes(), start).expect("ASCII text");
            pieces.push(&text[start..end]);
            start = end;
        }
        pieces
    }

    #[test]
    fn splits_as_the_cl100k_regex_does() {
        let text = "Hello world's 12345 items!!\n\n  they'RE here\t\tnow.  x  \n end ";
        let expected: Vec<&str> = bpe_openai::cl100k_base().split(text).collect();
        assert_eq!(pieces(text), expected);
    }

    #[test]
    fn ascii_letters_marks_exactly_the_letters() {
        for first in (0..=255u8).step_by(7) {
            for byte in 0..=255u8 {
                let bytes = [first, byte, b'a', b'Z', b'@', b'[', b'`', b'{'];
                let marks = ascii_letters(u64::from_le_bytes(bytes)).to_le_bytes();
                for (b, mark) in bytes.iter().zip(marks) {
                    assert_eq!(mark == 0x80, b.is_ascii_alphabetic(), "{b:#x} in {bytes:?}");
                    assert!(mark == 0 || mark == 0x80);
                }
            }
        }
    }

    #[test]
    fn gives_up_where_a_non_ascii_byte_decides() {
        for text in ["café", " é", "1٣", "  \u{a0}x", "!é"] {
            let start = 0;
            let decided = ascii_piece_end(text.as_bytes(), start);
            assert!(decided.is_none(), "{text:?}: {decided:?}");
        }
    }
}
