//! A test engine publisher, written from the wire format vLLM and SGLang document:
//! `[topic, sequence (u64 BE), msgpack batch]` on a PUB socket, and a ROUTER
//! replay socket that answers `[empty, start sequence]` with every buffered
//! `(sequence, payload)` from there on, then sequence -1 with an empty payload.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rmpv::Value;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How a block hash travels: vLLM's unsigned integers, SGLang's signed ones, or raw digest bytes.
#[derive(Clone, Debug)]
pub enum Hash {
    Unsigned(u64),
    Signed(i64),
    Bytes([u8; 32]),
}

impl Hash {
    /// The 64-bit id the bridge must derive from it.
    pub fn id(&self) -> u64 {
        match self {
            Hash::Unsigned(h) => *h,
            Hash::Signed(h) => *h as u64,
            Hash::Bytes(b) => u64::from_be_bytes(b[24..].try_into().unwrap()),
        }
    }

    fn value(&self) -> Value {
        match self {
            Hash::Unsigned(h) => Value::from(*h),
            Hash::Signed(h) => Value::from(*h),
            Hash::Bytes(b) => Value::Binary(b.to_vec()),
        }
    }
}

/// One engine event, before encoding.
#[derive(Clone, Debug)]
pub enum EngineEvent {
    Stored {
        hashes: Vec<Hash>,
        parent: Option<Hash>,
        tokens: Vec<u32>,
        block_size: u32,
        medium: Option<&'static str>,
        lora_name: Option<&'static str>,
    },
    Removed {
        hashes: Vec<Hash>,
        medium: Option<&'static str>,
    },
    Cleared,
}

/// The two generations of the format.
#[derive(Clone, Copy, Debug)]
pub enum Encoding {
    /// `[ts, events, rank]`, events as arrays tagged by class name, trailing defaults left out.
    Array,
    /// `{"ts", "events", "data_parallel_rank"}`, events as maps with a "type", defaults left out.
    Map,
}

pub fn encode(events: &[EngineEvent], encoding: Encoding, dp_rank: u32) -> Vec<u8> {
    let events = events.iter().map(|e| encode_event(e, encoding)).collect();
    let batch = match encoding {
        Encoding::Array => Value::Array(vec![
            Value::F64(1.0),
            Value::Array(events),
            Value::from(dp_rank),
        ]),
        Encoding::Map => map(vec![
            ("ts", Value::F64(1.0)),
            ("events", Value::Array(events)),
            ("data_parallel_rank", Value::from(dp_rank)),
        ]),
    };
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    bytes
}

fn encode_event(event: &EngineEvent, encoding: Encoding) -> Value {
    let (tag, fields): (&str, Vec<(&str, Value)>) = match event {
        EngineEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            medium,
            lora_name,
        } => (
            "BlockStored",
            vec![
                (
                    "block_hashes",
                    Value::Array(hashes.iter().map(Hash::value).collect()),
                ),
                (
                    "parent_block_hash",
                    parent.as_ref().map_or(Value::Nil, Hash::value),
                ),
                (
                    "token_ids",
                    Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
                ),
                ("block_size", Value::from(*block_size)),
                ("lora_id", lora_name.map_or(Value::Nil, |_| Value::from(1))),
                ("medium", medium.map_or(Value::Nil, Value::from)),
                ("lora_name", lora_name.map_or(Value::Nil, Value::from)),
            ],
        ),
        EngineEvent::Removed { hashes, medium } => (
            "BlockRemoved",
            vec![
                (
                    "block_hashes",
                    Value::Array(hashes.iter().map(Hash::value).collect()),
                ),
                ("medium", medium.map_or(Value::Nil, Value::from)),
            ],
        ),
        EngineEvent::Cleared => ("AllBlocksCleared", vec![]),
    };
    match encoding {
        Encoding::Array => {
            let mut items = vec![Value::from(tag)];
            items.extend(fields.into_iter().map(|(_, v)| v));
            while items.last().is_some_and(Value::is_nil) {
                items.pop();
            }
            Value::Array(items)
        }
        Encoding::Map => {
            let mut entries = vec![("type", Value::from(tag))];
            entries.extend(fields.into_iter().filter(|(_, v)| !v.is_nil()));
            map(entries)
        }
    }
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

/// One rank's publisher and replay buffer.
pub struct Publisher {
    events_port: u16,
    socket: PubSocket,
    topic: &'static str,
    next_seq: u64,
    buffer: Arc<Mutex<Vec<(u64, Bytes)>>>,
}

impl Publisher {
    /// Binds the PUB socket on `events_port` and, if given, a replay socket on `replay_port`.
    pub async fn bind(events_port: u16, replay_port: Option<u16>, topic: &'static str) -> Self {
        let buffer: Arc<Mutex<Vec<(u64, Bytes)>>> = Arc::default();
        if let Some(port) = replay_port {
            let mut replay = RouterSocket::new();
            replay
                .bind(&format!("tcp://127.0.0.1:{port}"))
                .await
                .unwrap();
            tokio::spawn(serve_replay(replay, buffer.clone()));
        }
        Self {
            events_port,
            socket: bind_pub(events_port).await,
            topic,
            next_seq: 0,
            buffer,
        }
    }

    /// Publishes the next batch.
    pub async fn publish(&mut self, payload: Vec<u8>) {
        let seq = self.buffer_next(payload.clone());
        let mut message = ZmqMessage::from(Bytes::from(self.topic));
        message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        message.push_back(Bytes::from(payload));
        self.socket.send(message).await.unwrap();
    }

    /// Buffers the next batch for replay without sending it: a batch ZeroMQ dropped.
    pub fn drop_next(&mut self, payload: Vec<u8>) {
        self.buffer_next(payload);
    }

    fn buffer_next(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.buffer
            .lock()
            .unwrap()
            .push((seq, Bytes::from(payload)));
        seq
    }

    /// The engine restarts: a new socket on the same port, sequences from 0, an empty buffer.
    pub async fn restart(&mut self) {
        let old = std::mem::replace(&mut self.socket, PubSocket::new());
        drop(old.close().await);
        self.socket = bind_pub(self.events_port).await;
        self.next_seq = 0;
        self.buffer.lock().unwrap().clear();
    }
}

async fn bind_pub(port: u16) -> PubSocket {
    let mut socket = PubSocket::new();
    socket
        .bind(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    socket
}

async fn serve_replay(mut socket: RouterSocket, buffer: Arc<Mutex<Vec<(u64, Bytes)>>>) {
    while let Ok(request) = socket.recv().await {
        let frames = request.into_vec();
        let [identity, _empty, start] = frames.as_slice() else {
            continue;
        };
        let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
        let batches: Vec<_> = buffer
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply = |seq: Bytes, payload: Bytes| {
            let mut message = ZmqMessage::from(identity.clone());
            message.push_back(Bytes::new());
            message.push_back(seq);
            message.push_back(payload);
            message
        };
        for (seq, payload) in batches {
            socket
                .send(reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload))
                .await
                .unwrap();
        }
        socket
            .send(reply(
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
            ))
            .await
            .unwrap();
    }
}
