//! A small real gRPC router for the bridge to talk to: it applies what it
//! receives to a `KvIndex` exactly as the protocol says (events in id order, a
//! resync request on a gap, a dump replaces the rank), refuses a foreign block
//! size, and keeps registrations and load reports for the tests to inspect.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use kvroute_index::{ApplyOutcome, EventKind, KvEvent, KvIndex, StoredBlock, WorkerKey};
use kvroute_proto as proto;
use kvroute_proto::kv_router_server::{KvRouter, KvRouterServer};
use proto::worker_message::Body;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

pub const ROUTER_BLOCK_SIZE: u32 = 4;

#[derive(Default)]
pub struct Recorded {
    pub index: KvIndex,
    pub registrations: Mutex<Vec<proto::Register>>,
    pub loads: Mutex<Vec<proto::LoadReport>>,
    pub dumps: Mutex<u64>,
    pub resyncs_sent: Mutex<u64>,
    /// A rank whose next event batch is lost on purpose, as by a router whose queue overflowed.
    pub lose_next_batch_of: Mutex<Option<u32>>,
    /// Digests received: (dp rank, event id, whether they equal the index's at
    /// that id; `None` when the index is at another id).
    pub digests: Mutex<Vec<(u32, u64, Option<bool>)>>,
}

#[derive(Clone)]
struct Recorder(Arc<Recorded>);

/// Serves the recorder on `addr` (port 0: any) and returns where it listens.
pub async fn start(addr: SocketAddr, recorded: Arc<Recorded>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let local = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvRouterServer::new(Recorder(recorded)))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    local
}

type Replies = Pin<Box<dyn Stream<Item = Result<proto::RouterMessage, Status>> + Send>>;

#[tonic::async_trait]
impl KvRouter for Recorder {
    type StreamStream = Replies;

    async fn stream(
        &self,
        request: Request<Streaming<proto::WorkerMessage>>,
    ) -> Result<Response<Replies>, Status> {
        let mut inbound = request.into_inner();
        let Some(Ok(proto::WorkerMessage {
            body: Some(Body::Register(register)),
        })) = inbound.next().await
        else {
            return Err(Status::invalid_argument(
                "the first message must register the worker",
            ));
        };
        if register.block_size != ROUTER_BLOCK_SIZE {
            return Err(Status::invalid_argument(format!(
                "block size {} does not match the router's {ROUTER_BLOCK_SIZE}",
                register.block_size
            )));
        }
        let worker_id = register.worker_id;
        self.0.registrations.lock().unwrap().push(register);
        let (replies, replies_rx) = mpsc::channel(64);
        let recorded = self.0.clone();
        tokio::spawn(async move {
            while let Some(Ok(message)) = inbound.next().await {
                let Some(body) = message.body else { continue };
                for reply in recorded.on_message(worker_id, body) {
                    let _ = replies.send(Ok(reply)).await;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(replies_rx))))
    }

    async fn route(
        &self,
        _request: Request<proto::RouteRequest>,
    ) -> Result<Response<proto::RouteResponse>, Status> {
        Err(Status::unimplemented("the recorder does not route"))
    }
}

impl Recorded {
    fn on_message(&self, worker_id: u64, body: Body) -> Vec<proto::RouterMessage> {
        match body {
            Body::Events(batch) => {
                {
                    let mut lose = self.lose_next_batch_of.lock().unwrap();
                    if *lose == Some(batch.dp_rank) && !batch.events.is_empty() {
                        *lose = None;
                        return vec![];
                    }
                }
                let key = WorkerKey::new(worker_id, batch.dp_rank);
                for event in &batch.events {
                    if let ApplyOutcome::Gap { expected, .. } =
                        self.index.apply(key, &event_from_proto(event))
                    {
                        *self.resyncs_sent.lock().unwrap() += 1;
                        let resync = proto::ResyncRequest {
                            dp_rank: batch.dp_rank,
                            from_event_id: expected,
                        };
                        return vec![proto::RouterMessage {
                            body: Some(proto::router_message::Body::Resync(resync)),
                        }];
                    }
                }
                vec![]
            }
            Body::Dump(dump) => {
                *self.dumps.lock().unwrap() += 1;
                let chains: Vec<_> = dump.chains.iter().map(stored_from_proto).collect();
                self.index.replace_worker(
                    WorkerKey::new(worker_id, dump.dp_rank),
                    dump.last_event_id,
                    &chains,
                );
                vec![]
            }
            Body::Load(load) => {
                self.loads.lock().unwrap().push(load);
                vec![]
            }
            Body::Digest(digest) => {
                let indexed = self
                    .index
                    .digest(WorkerKey::new(worker_id, digest.dp_rank))
                    .filter(|i| i.last_event_id == Some(digest.last_event_id));
                let verdict = indexed.map(|i| {
                    (i.digest.block_count, i.digest.block_set_hash)
                        == (digest.block_count, digest.block_set_hash)
                });
                let entry = (digest.dp_rank, digest.last_event_id, verdict);
                self.digests.lock().unwrap().push(entry);
                vec![]
            }
            Body::Register(_) => vec![],
        }
    }
}

fn stored_from_proto(stored: &proto::Stored) -> EventKind {
    EventKind::Stored {
        parent_hash: stored.parent_hash,
        blocks: stored
            .blocks
            .iter()
            .map(|b| StoredBlock {
                block_hash: b.block_hash,
                tokens_hash: b.tokens_hash,
            })
            .collect(),
    }
}

fn event_from_proto(event: &proto::KvEvent) -> KvEvent {
    use proto::kv_event::Kind;
    let kind = match event.kind.as_ref().expect("an event without a kind") {
        Kind::Stored(stored) => stored_from_proto(stored),
        Kind::Removed(removed) => EventKind::Removed {
            block_hashes: removed.block_hashes.clone(),
        },
        Kind::Cleared(_) => EventKind::Cleared,
    };
    KvEvent {
        event_id: event.event_id,
        kind,
    }
}
