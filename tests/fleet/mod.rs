//! Helpers for end-to-end tests: real `kvroute` processes on loopback and a
//! tiny blocking HTTP/1.1 client (one request per connection).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed when dropped.
pub struct Proc {
    child: Child,
    pub lines: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvroute ARGS` and reads stdout lines until `ready` says enough were read.
pub fn spawn(args: &[&str], ready: impl Fn(&[String]) -> bool) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvroute starts");
    let stdout = child.stdout.take().unwrap();
    let mut reader = BufReader::new(stdout);
    let mut lines = Vec::new();
    while !ready(&lines) {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("kvroute {args:?} exited; printed {lines:?}");
        }
        lines.push(line.trim().to_string());
    }
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || {
        let mut sink = String::new();
        let _ = reader.read_to_string(&mut sink);
    });
    Proc { child, lines }
}

/// A router on free ports: (process, http address, grpc address).
pub fn router(extra: &[&str]) -> (Proc, String, String) {
    router_on("127.0.0.1:0", extra)
}

/// A router whose gRPC ingest listens on `grpc` (HTTP on a free port).
pub fn router_on(grpc: &str, extra: &[&str]) -> (Proc, String, String) {
    let mut args = vec![
        "serve",
        "--http-addr",
        "127.0.0.1:0",
        "--grpc-addr",
        grpc,
        "--block-size",
        "16",
    ];
    args.extend_from_slice(extra);
    let proc = spawn(&args, |lines| {
        lines.iter().any(|l| l.starts_with("listening "))
    });
    let line = proc
        .lines
        .iter()
        .find(|l| l.starts_with("listening "))
        .unwrap()
        .clone();
    let http = line
        .split("http=")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    let grpc = line.split("grpc=").nth(1).unwrap().trim().to_string();
    (proc, http, grpc)
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `n` simulated workers registered with the router at `grpc`: (process, [(id, http address)]).
pub fn sim(grpc: &str, n: usize) -> (Proc, Vec<(u64, String)>) {
    let router = format!("http://{grpc}");
    let count = n.to_string();
    let args = [
        "sim",
        "--workers",
        &count,
        "--router",
        &router,
        "--block-size",
        "16",
        "--kv-blocks",
        "256",
        "--speedup",
        "100",
        "--load-report-ms",
        "50",
    ];
    let proc = spawn(&args, |lines| {
        lines.iter().filter(|l| l.starts_with("worker ")).count() == n
    });
    let workers = proc
        .lines
        .iter()
        .filter_map(|l| {
            let mut parts = l.split(' ');
            parts.next()?;
            let id = parts.next()?.parse().ok()?;
            let url = parts.next()?.trim_start_matches("http://").to_string();
            Some((id, url))
        })
        .collect();
    (proc, workers)
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

pub fn request(
    method: &str,
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    let mut stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap_or("")
        .split(' ')
        .nth(1)
        .unwrap_or("0")
        .parse()
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.push_str(&tail[..size]);
        rest = &tail[size + 2..];
    }
    out
}

pub fn get(addr: &str, path: &str) -> Response {
    request("GET", addr, path, &[], "")
}

pub fn post(addr: &str, path: &str, body: &serde_json::Value) -> Response {
    request("POST", addr, path, &[], &body.to_string())
}

/// A completion of `tokens` through `addr`, optionally pinned to a worker.
pub fn complete(addr: &str, tokens: &[u32], pin: Option<u64>) -> Response {
    let body = serde_json::json!({"model": "sim-model", "prompt": tokens, "max_tokens": 2});
    let pin = pin.map(|p| p.to_string());
    let headers: Vec<(&str, &str)> = pin
        .iter()
        .map(|p| ("x-kvroute-worker", p.as_str()))
        .collect();
    request("POST", addr, "/v1/completions", &headers, &body.to_string())
}

/// Polls `check` until it returns Some or `secs` pass.
pub fn wait_for<T>(secs: u64, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The router's view of a worker's rank 0: (indexed blocks, last event id).
pub fn indexed(router: &str, worker: u64) -> (u64, u64) {
    let info = get(router, &format!("/workers/{worker}")).json();
    let rank = &info["index"][0];
    (
        rank["indexed_blocks"].as_u64().unwrap_or(0),
        rank["last_event_id"].as_u64().unwrap_or(0),
    )
}

/// The value of a sample line starting with `prefix` in Prometheus text.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn wait_registered(router: &str, n: usize) {
    wait_for(20, "workers to register", || {
        let workers = get(router, "/workers").json();
        let connected = workers["workers"]
            .as_array()?
            .iter()
            .filter(|w| w["state"] == "connected")
            .count();
        (connected == n).then_some(())
    });
}
