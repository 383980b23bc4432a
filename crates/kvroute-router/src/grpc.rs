//! The workers' gRPC service, `KvRouter`: its event streams are [`ingest`]'s;
//! its unary `Route` RPC is answered here, through the same routing entry
//! point as the HTTP API, so a caller that forwards the request itself gets
//! the proxy's decision, and the prediction is remembered as the proxy's is.
//!
//! [`ingest`]: crate::ingest

use std::sync::Arc;

use kvroute_proto::kv_router_server::KvRouter;
use kvroute_proto::{RouteRequest, RouteResponse, WorkerMessage, WorkerScore, route_request};
use tonic::{Request, Response, Status, Streaming};

use crate::error::RouterError;
use crate::ingest::{Ingest, RouterStream};
use crate::state::{AppState, RouteInput};

pub struct KvRouterService {
    ingest: Ingest,
    state: Arc<AppState>,
}

impl KvRouterService {
    pub fn new(ingest: Ingest, state: Arc<AppState>) -> Self {
        Self { ingest, state }
    }
}

#[tonic::async_trait]
impl KvRouter for KvRouterService {
    type StreamStream = RouterStream;

    async fn stream(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        self.ingest.stream(request).await
    }

    async fn route(
        &self,
        request: Request<RouteRequest>,
    ) -> Result<Response<RouteResponse>, Status> {
        // It writes predictions, which steer everyone's requests: an operator's call.
        self.state.credentials.admin_grpc(request.metadata())?;
        let request = request.into_inner();
        let name = if request.lora_name.is_empty() {
            request.model.as_str()
        } else {
            request.lora_name.as_str()
        };
        let input = match &request.input {
            Some(route_request::Input::TokenIds(t)) => RouteInput::Tokens(&t.ids),
            Some(route_request::Input::LocalHashes(h)) => RouteInput::LocalHashes(&h.hashes),
            None => RouteInput::Tokens(&[]),
        };
        let routed = self
            .state
            .route(name, input, None, &[])
            .await
            .map_err(|e| match e {
                RouterError::UnknownModel(_) => Status::not_found(e.to_string()),
                _ => Status::unavailable(e.to_string()),
            })?;
        let d = &routed.decision;
        // The caller will send the request there: remember it like a proxied one.
        self.state.record_prediction(&routed);
        Ok(Response::new(RouteResponse {
            worker_id: d.worker.worker_id,
            dp_rank: d.worker.dp_rank,
            scores: d
                .scores
                .iter()
                .map(|s| WorkerScore {
                    worker_id: s.worker_id,
                    dp_rank: s.dp_rank,
                    overlap_blocks: s.overlap_blocks,
                    cost: s.cost,
                })
                .collect(),
        }))
    }
}
