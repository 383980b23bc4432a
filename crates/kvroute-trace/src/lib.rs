//! kvroute-trace: reads Mooncake request traces (JSON Lines).
//!
//! Each line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [block ids]}`, where equal ids are reusable KV blocks of a fixed
//! size (512 tokens in the Mooncake FAST'25 traces). The benchmarks, the
//! cache-policy lab and the simulator all replay these traces, so a bad line must
//! name its file, line and field instead of panicking halfway through a run.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp_ms: u64,
    pub input_length: u64,
    pub output_length: u64,
    /// Block ids of the prompt, in order; equal ids share KV blocks.
    pub hash_ids: Vec<u64>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The reason is the error's `source`, which `{:#}` and error reporters print.
    #[error("cannot read trace {path}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// Reads a whole trace file; at most `max_requests` requests when given.
pub fn read_trace(
    path: &Path,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(&text, max_requests).map_err(|(line, message)| TraceError::Line {
        path: path.to_owned(),
        line,
        message,
    })
}

/// Parses trace text; on error gives the 1-based line number and what is wrong.
/// Blank lines are skipped.
pub fn parse_trace(
    text: &str,
    max_requests: Option<usize>,
) -> Result<Vec<TraceRequest>, (usize, String)> {
    let limit = max_requests.unwrap_or(usize::MAX);
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .take(limit)
        .map(|(i, line)| parse_request(line).map_err(|message| (i + 1, message)))
        .collect()
}

/// Parses one JSON line of a trace.
pub fn parse_request(line: &str) -> Result<TraceRequest, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    let Value::Object(fields) = value else {
        return Err("expected a JSON object".to_owned());
    };
    let number = |name: &str| -> Result<u64, String> {
        let field = fields
            .get(name)
            .ok_or_else(|| format!("missing field `{name}`"))?;
        as_u64(field)
            .ok_or_else(|| format!("field `{name}`: expected a non-negative integer, got {field}"))
    };
    let hash_ids = match fields.get("hash_ids") {
        None => return Err("missing field `hash_ids`".to_owned()),
        Some(Value::Array(ids)) => ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                id.as_u64().ok_or_else(|| {
                    format!("field `hash_ids`[{i}]: expected a non-negative integer, got {id}")
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(other) => return Err(format!("field `hash_ids`: expected an array, got {other}")),
    };
    Ok(TraceRequest {
        timestamp_ms: number("timestamp")?,
        input_length: number("input_length")?,
        output_length: number("output_length")?,
        hash_ids,
    })
}

/// Integers, and floats with no fractional part (some trace tools write `12.0`).
fn as_u64(value: &Value) -> Option<u64> {
    value.as_u64().or_else(|| {
        let f = value.as_f64()?;
        (f >= 0.0 && f.fract() == 0.0 && f <= u64::MAX as f64).then_some(f as u64)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_mooncake_line() {
        let r = parse_request(
            r#"{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            TraceRequest {
                timestamp_ms: 5,
                input_length: 700,
                output_length: 3,
                hash_ids: vec![0, 1]
            }
        );
    }

    #[test]
    fn errors_name_the_line_and_field() {
        let text = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\
                    {\"timestamp\": 0, \"input_length\": \"x\", \"output_length\": 1, \"hash_ids\": [0]}\n";
        let (line, message) = parse_trace(text, None).unwrap_err();
        assert_eq!(line, 2);
        assert!(message.contains("input_length"), "{message}");

        let (_, message) = parse_trace(
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}",
            None,
        )
        .unwrap_err();
        assert!(message.contains("missing field `hash_ids`"), "{message}");

        let (_, message) = parse_trace(
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [-1]}",
            None,
        )
        .unwrap_err();
        assert!(message.contains("hash_ids`[0]"), "{message}");

        let (_, message) = parse_trace("not json", None).unwrap_err();
        assert!(message.contains("invalid JSON"), "{message}");
    }

    #[test]
    fn max_requests_stops_early_and_skips_blank_lines() {
        let line =
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}";
        let text = format!("{line}\n\n{line}\n{line}\nbroken");
        assert_eq!(parse_trace(&text, Some(3)).unwrap().len(), 3);
        assert!(parse_trace(&text, None).is_err());
    }

    #[test]
    fn reads_the_bundled_traces() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/traces");
        let conversation = read_trace(&dir.join("conversation_trace.jsonl"), None).unwrap();
        assert_eq!(conversation.len(), 12_031);
        let total: u64 = conversation.iter().map(|r| r.input_length).sum();
        assert_eq!(total, 144_793_823);
        let synthetic = read_trace(&dir.join("synthetic_trace.jsonl"), None).unwrap();
        assert_eq!(synthetic.len(), 3_993);
    }

    #[test]
    fn missing_file_is_an_io_error_naming_the_path() {
        let err = read_trace(Path::new("/nonexistent/trace.jsonl"), None).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/trace.jsonl"));
        let reason = std::error::Error::source(&err).map(ToString::to_string);
        assert!(
            reason
                .as_deref()
                .is_some_and(|r| r.contains("No such file")),
            "{reason:?}"
        );
    }
}
