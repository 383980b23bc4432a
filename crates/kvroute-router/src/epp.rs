//! The endpoint picker (EPP) of the Gateway API Inference Extension: Envoy's
//! ext_proc v3 service, for gateways that proxy requests themselves and ask
//! kvroute only which worker should serve each one (`[epp] addr`).
//!
//! Per request, one ext_proc stream with bodies in `FULL_DUPLEX_STREAMED`:
//! - request headers, then body chunks gathered to `end_of_stream`; then the
//!   body is parsed, tokenized, hashed, scored and booked by the same code as
//!   the proxy's ([`crate::http::api::parse`], [`AppState::route_and_book`]), and the
//!   answer is the request-headers response (`x-gateway-destination-endpoint`
//!   best first then fallbacks, the same in `dynamic_metadata["envoy.lb"]`,
//!   `clear_route_cache`), then the body as `streamed_response` chunks;
//! - response headers and body pass through, with `x-kvroute-worker` added.
//!   The first body chunk releases the prefill booking (a stream's first
//!   token); the end of the response releases the rest. A stream that closes
//!   before that (client gone, Envoy reset) drops the booking, which releases
//!   everything, as a cancelled proxied request does.
//!
//! Errors are `ImmediateResponse`s with OpenAI-style JSON bodies: 503 when no
//! worker can take the request, 429 when the wait queue would refuse it, 400
//! for a body that does not parse. A bodyless request is answered at once
//! without a pick, leaving the choice to the gateway's fallback policy.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap as EnvoyHeaders, HeaderValue as EnvoyHeader, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use kvroute_index::{OwnedPinnedPath, WorkerKey};
use kvroute_tls::{Serves, TlsListener};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use crate::error::RouterError;
use crate::fleet::booking::Booking;
use crate::http::api::Endpoint;
use crate::http::proxy::WORKER_HEADER;
use crate::state::AppState;

/// The request header (and `envoy.lb` metadata key) naming the picked
/// endpoints, `host:port[,host:port…]`, best first.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// Metadata namespace the gateway's load balancer reads the pick from, and
/// writes the endpoint it served from into.
const LB_NAMESPACE: &str = "envoy.lb";
/// Where the gateway limits the pick to a subset of endpoints.
const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The endpoint the gateway actually sent the request to (after retries).
const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Largest `streamed_response` chunk: the reference EPP's, under the 64 KiB
/// that some gateways' ext_proc buffers take.
pub const MAX_CHUNK_BYTES: usize = 62_000;
/// How often readiness is re-read from the registry.
const READINESS_INTERVAL: Duration = Duration::from_secs(1);

/// Serves the endpoint picker and gRPC health on `listener` (TLS with
/// `tls`) until `stopped` turns true.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<kvroute_tls::ServerConfig>>,
    state: Arc<AppState>,
    mut stopped: watch::Receiver<bool>,
) {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<ExternalProcessorServer<Epp>>().await;
    health
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let readiness = tokio::spawn(report_readiness(
        health,
        Arc::clone(&state),
        stopped.clone(),
    ));
    let max_message = state.config.body_limit_bytes.max(MAX_CHUNK_BYTES) + 4096;
    let epp = ExternalProcessorServer::new(Epp { state })
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
    let server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(epp);
    let shutdown = async move {
        let _ = stopped.wait_for(|&s| s).await;
    };
    let result = match tls {
        None => {
            let incoming = TcpListenerStream::new(listener).inspect(|tcp| {
                if let Ok(tcp) = tcp {
                    let _ = tcp.set_nodelay(true);
                }
            });
            server
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Some(config) => {
            let listener = TlsListener::new(
                listener,
                config,
                Serves::Grpc,
                crate::connections::count_tls_failure,
            );
            server
                .serve_with_incoming_shutdown(crate::connections::incoming(listener), shutdown)
                .await
        }
    };
    readiness.abort();
    if let Err(e) = result {
        tracing::error!("endpoint picker failed: {e}");
    }
}

/// `readiness` is serving while some worker is routable (and, in a cluster,
/// the replica has caught up with the shared log), as `/readyz` says.
async fn report_readiness(
    health: tonic_health::server::HealthReporter,
    state: Arc<AppState>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let ready =
            state.registry.any_routable() && state.replica.get().is_none_or(|r| r.caught_up());
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        health.set_service_status("readiness", status).await;
        tokio::select! {
            _ = tokio::time::sleep(READINESS_INTERVAL) => {}
            _ = stopped.wait_for(|&s| s) => return,
        }
    }
}

/// Binds `[epp] addr`, if set; before serving, so a taken port stops the start.
pub async fn bind(addr: Option<SocketAddr>) -> Result<Option<TcpListener>, RouterError> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|e| RouterError::Config(format!("cannot listen on epp.addr {addr}: {e}")))
}

/// Envoy's ext_proc service over the router's state.
pub struct Epp {
    state: Arc<AppState>,
}

#[tonic::async_trait]
impl ExternalProcessor for Epp {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        // Bounded: a gateway that stops reading holds the exchange, not memory.
        let (out, answers) = mpsc::channel(16);
        let exchange = Exchange {
            state: Arc::clone(&self.state),
            out,
            headers: HeaderMap::new(),
            endpoint: None,
            subset: None,
            body: BytesMut::new(),
            picked: None,
        };
        tokio::spawn(exchange.run(inbound));
        Ok(Response::new(ReceiverStream::new(answers)))
    }
}

/// One request's ext_proc stream.
struct Exchange {
    state: Arc<AppState>,
    out: mpsc::Sender<Result<ProcessingResponse, Status>>,
    /// The client's request headers (pseudo-headers left out).
    headers: HeaderMap,
    endpoint: Option<Endpoint>,
    /// The endpoints the gateway allows, when it says.
    subset: Option<Vec<String>>,
    /// The request body gathered so far, at most `body_limit_bytes`.
    body: BytesMut,
    picked: Option<Picked>,
}

/// A routed request, from its pick to the end of its response.
struct Picked {
    /// Released in parts as the response goes (see the module doc); dropped
    /// with the exchange, whatever is still booked is released.
    booking: Booking,
    /// The candidates offered to the gateway, best first: (endpoint, rank).
    candidates: Vec<(String, WorkerKey)>,
    new_prefill_tokens: u64,
    request_blocks: u64,
    /// The worker uses these blocks until the response ends: kept indexed.
    _blocks: OwnedPinnedPath,
    picked_at: tokio::time::Instant,
    /// The response streams (SSE): its first chunk is the first token.
    sse: bool,
    first_chunk_seen: bool,
}

/// What ended an exchange early: the gateway's stream failed or closed.
struct Closed;

impl Exchange {
    async fn run(mut self, mut inbound: Streaming<ProcessingRequest>) {
        loop {
            let message = match inbound.message().await {
                Ok(Some(message)) => message,
                Ok(None) | Err(_) => break,
            };
            if self.handle(message).await.is_err() {
                break;
            }
        }
        // Closed or reset before the response ended: a cancel, as through
        // the proxy. The booking drops with `self`, releasing everything.
        if self.picked.is_some() {
            ::metrics::counter!(crate::metrics::CANCELLED).increment(1);
        }
    }

    async fn handle(&mut self, message: ProcessingRequest) -> Result<(), Closed> {
        let ProcessingRequest {
            request,
            metadata_context,
            ..
        } = message;
        match request {
            Some(Message::RequestHeaders(headers)) => {
                self.read_request_headers(headers.headers.unwrap_or_default());
                self.subset = metadata_context.as_ref().and_then(subset_hint);
                if headers.end_of_stream {
                    // Nothing to route on: the gateway's own policy picks.
                    return self
                        .send(Answer::RequestHeaders(HeadersResponse::default()))
                        .await;
                }
                Ok(())
            }
            Some(Message::RequestBody(body)) => {
                let limit = self.state.config.body_limit_bytes;
                if self.body.len() + body.body.len() > limit {
                    return self.refuse(RouterError::PayloadTooLarge(limit)).await;
                }
                self.body.extend_from_slice(&body.body);
                if body.end_of_stream {
                    return self.pick().await;
                }
                Ok(())
            }
            Some(Message::RequestTrailers(_)) => {
                if self.picked.is_none() {
                    self.pick().await?;
                }
                self.send(Answer::RequestTrailers(TrailersResponse::default()))
                    .await
            }
            Some(Message::ResponseHeaders(headers)) => {
                if let Some(served) = metadata_context.as_ref().and_then(served_endpoint) {
                    self.move_booking(&served);
                }
                let headers = headers.headers.unwrap_or_default();
                let mutation = self.picked.as_mut().map(|picked| {
                    picked.sse = header_value(&headers, header::CONTENT_TYPE.as_str())
                        .is_some_and(|v| v.starts_with(b"text/event-stream"));
                    HeaderMutation {
                        set_headers: vec![set_header(
                            WORKER_HEADER,
                            picked.booking.key().worker_id.to_string(),
                        )],
                        remove_headers: Vec::new(),
                    }
                });
                self.send(Answer::ResponseHeaders(HeadersResponse {
                    response: Some(CommonResponse {
                        header_mutation: mutation,
                        ..Default::default()
                    }),
                }))
                .await
            }
            Some(Message::ResponseBody(body)) => {
                if let Some(picked) = self.picked.as_mut()
                    && !picked.first_chunk_seen
                {
                    picked.first_chunk_seen = true;
                    if picked.sse {
                        picked.booking.first_token(picked.picked_at.elapsed());
                    } else {
                        picked.booking.release_prefill();
                    }
                }
                let end = body.end_of_stream;
                self.send(streamed_body(Answer::ResponseBody, body.body, end))
                    .await?;
                if end {
                    self.finish();
                }
                Ok(())
            }
            Some(Message::ResponseTrailers(_)) => {
                self.send(Answer::ResponseTrailers(TrailersResponse::default()))
                    .await?;
                self.finish();
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn read_request_headers(&mut self, headers: EnvoyHeaders) {
        for h in headers.headers {
            let value = if h.raw_value.is_empty() {
                h.value.into_bytes()
            } else {
                h.raw_value
            };
            if h.key == ":path" {
                let path = String::from_utf8_lossy(&value);
                let path = path.split('?').next().unwrap_or_default();
                self.endpoint = Endpoint::of_path(path);
                continue;
            }
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(h.key.as_bytes()),
                HeaderValue::from_bytes(&value),
            ) {
                self.headers.append(name, value);
            }
        }
    }

    /// Routes the gathered body and answers with the pick, then the body.
    async fn pick(&mut self) -> Result<(), Closed> {
        let body = std::mem::take(&mut self.body).freeze();
        let picked = match self.route(&body).await {
            Ok(picked) => picked,
            Err(e) => return self.refuse(e).await,
        };
        let destination = picked
            .candidates
            .iter()
            .map(|(endpoint, _)| endpoint.as_str())
            .collect::<Vec<_>>()
            .join(",");
        self.picked = Some(picked);
        let lb = Struct {
            fields: [(DESTINATION.to_string(), string_value(destination.clone()))].into(),
        };
        let headers = ProcessingResponse {
            response: Some(Answer::RequestHeaders(HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers: vec![set_header(DESTINATION, destination)],
                        remove_headers: Vec::new(),
                    }),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            })),
            dynamic_metadata: Some(Struct {
                fields: [(
                    LB_NAMESPACE.to_string(),
                    Value {
                        kind: Some(Kind::StructValue(lb)),
                    },
                )]
                .into(),
            }),
            ..Default::default()
        };
        self.send_response(headers).await?;
        let mut chunks = body.chunks(MAX_CHUNK_BYTES).peekable();
        if chunks.peek().is_none() {
            return self
                .send(streamed_body(Answer::RequestBody, Vec::new(), true))
                .await;
        }
        while let Some(chunk) = chunks.next() {
            let end = chunks.peek().is_none();
            self.send(streamed_body(Answer::RequestBody, chunk.to_vec(), end))
                .await?;
        }
        Ok(())
    }

    /// The proxy's parse and routing, for the gateway to forward.
    async fn route(&self, body: &Bytes) -> Result<Picked, RouterError> {
        let state = &self.state;
        let parsed = crate::http::api::parse(state, &self.headers, body, self.endpoint).await?;
        let exclude = match &self.subset {
            None => Vec::new(),
            Some(subset) => {
                let fleet = state.registry.lock();
                let outside: Vec<u64> = fleet
                    .workers
                    .values()
                    .filter(|w| !subset.iter().any(|e| *e == endpoint_of(&w.base_url)))
                    .map(|w| w.id)
                    .collect();
                if outside.len() == fleet.workers.len() {
                    return Err(RouterError::Unavailable {
                        message: "no worker in the gateway's endpoint subset".into(),
                        retry_after_s: 1,
                    });
                }
                outside
            }
        };
        let routed = state
            .route_and_book(&parsed.model, parsed.route_input(), parsed.pin, &exclude)
            .await?;
        state.record_prediction(&routed);
        let blocks = state.index.pin_path_owned(&routed.local_hashes);
        let decision = &routed.decision;
        let mut candidates = vec![(endpoint_of(&decision.base_url), decision.worker)];
        if parsed.pin.is_none() {
            let fleet = state.registry.lock();
            for score in &decision.scores {
                let taken = candidates
                    .iter()
                    .any(|(_, k)| k.worker_id == score.worker_id);
                if taken || exclude.contains(&score.worker_id) {
                    continue;
                }
                if let Some(worker) = fleet.workers.get(&score.worker_id) {
                    let key = WorkerKey::new(score.worker_id, score.dp_rank);
                    candidates.push((endpoint_of(&worker.base_url), key));
                }
            }
        }
        Ok(Picked {
            booking: routed.booking,
            candidates,
            new_prefill_tokens: routed.decision.new_prefill_tokens,
            request_blocks: routed.decision.request_blocks,
            _blocks: blocks,
            picked_at: tokio::time::Instant::now(),
            sse: false,
            first_chunk_seen: false,
        })
    }

    /// The gateway served the request from `served`: a retry that moved it to
    /// a fallback moves its booking there too.
    fn move_booking(&mut self, served: &str) {
        let Some(picked) = self.picked.as_mut() else {
            return;
        };
        let booked = picked.booking.key();
        let Some(&(_, key)) = picked.candidates.iter().find(|(e, _)| e == served) else {
            return;
        };
        if key == booked {
            return;
        }
        // The first worker did not serve: its breaker hears of it.
        picked.booking.record_outcome(false);
        picked.booking =
            self.state
                .registry
                .book(key, picked.new_prefill_tokens, picked.request_blocks);
    }

    /// The response ended: its worker served it.
    fn finish(&mut self) {
        if let Some(mut picked) = self.picked.take() {
            picked.booking.record_outcome(true);
        }
    }

    /// Answers the client with `error` instead of forwarding the request,
    /// which ends the exchange.
    async fn refuse(&mut self, error: RouterError) -> Result<(), Closed> {
        let status = match error {
            RouterError::QueueFull => StatusCode::TOO_MANY_REQUESTS,
            _ => error.status(),
        };
        let mut set_headers = vec![set_header(
            header::CONTENT_TYPE.as_str(),
            "application/json".into(),
        )];
        if matches!(
            error,
            RouterError::QueueFull | RouterError::Unavailable { .. } | RouterError::Overloaded(_)
        ) {
            set_headers.push(set_header(header::RETRY_AFTER.as_str(), "1".into()));
        }
        let answer = ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status.as_u16()),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body: error.body().to_string().into_bytes(),
            details: format!("kvroute: {}", status.as_u16()),
            ..Default::default()
        };
        self.send(Answer::ImmediateResponse(answer)).await?;
        Err(Closed)
    }

    async fn send(&self, answer: Answer) -> Result<(), Closed> {
        self.send_response(ProcessingResponse {
            response: Some(answer),
            ..Default::default()
        })
        .await
    }

    async fn send_response(&self, response: ProcessingResponse) -> Result<(), Closed> {
        self.out.send(Ok(response)).await.map_err(|_| Closed)
    }
}

/// A body chunk given back to the gateway in full-duplex streaming mode.
fn streamed_body(
    direction: fn(BodyResponse) -> Answer,
    body: Vec<u8>,
    end_of_stream: bool,
) -> Answer {
    direction(BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    })
}

/// A header set on the request or response, replacing any the client sent
/// (a client must not pick its own endpoint or fake the worker header).
fn set_header(key: &str, value: String) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(EnvoyHeader {
            key: key.to_string(),
            raw_value: value.into_bytes(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn header_value<'a>(headers: &'a EnvoyHeaders, key: &str) -> Option<&'a [u8]> {
    let h = headers.headers.iter().find(|h| h.key == key)?;
    Some(if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    })
}

fn string_value(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

/// A worker's registered URL as the gateway names endpoints: `host:port`.
fn endpoint_of(base_url: &str) -> String {
    let authority = base_url.parse::<http::Uri>().ok().and_then(|uri| {
        let authority = uri.authority()?;
        let port = authority.port_u16().unwrap_or(match uri.scheme_str() {
            Some("https") => 443,
            _ => 80,
        });
        Some(format!("{}:{port}", authority.host()))
    });
    authority.unwrap_or_default()
}

/// A string or list of strings under `key` in `namespace`, split at commas.
fn endpoints_in(metadata: &Metadata, namespace: &str, key: &str) -> Option<Vec<String>> {
    let value = metadata.filter_metadata.get(namespace)?.fields.get(key)?;
    let strings: Vec<&str> = match value.kind.as_ref()? {
        Kind::StringValue(s) => vec![s.as_str()],
        Kind::ListValue(ListValue { values }) => values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            })
            .collect(),
        _ => return None,
    };
    Some(
        strings
            .iter()
            .flat_map(|s| s.split(','))
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect(),
    )
}

fn subset_hint(metadata: &Metadata) -> Option<Vec<String>> {
    endpoints_in(metadata, SUBSET_NAMESPACE, SUBSET_KEY)
}

fn served_endpoint(metadata: &Metadata) -> Option<String> {
    endpoints_in(metadata, LB_NAMESPACE, SERVED_KEY)?
        .into_iter()
        .next()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_url_names_its_endpoint_as_host_and_port() {
        assert_eq!(endpoint_of("http://10.0.0.5:8000"), "10.0.0.5:8000");
        assert_eq!(endpoint_of("http://w:8000/v1"), "w:8000");
        assert_eq!(endpoint_of("https://w"), "w:443");
        assert_eq!(endpoint_of("http://[::1]:9"), "[::1]:9");
    }

    #[test]
    fn subset_hints_are_read_from_a_string_or_a_list() {
        let hint = |value: Value| Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), value)].into(),
                },
            )]
            .into(),
            ..Default::default()
        };
        let one = hint(string_value("a:1, b:2".into()));
        assert_eq!(subset_hint(&one).unwrap(), ["a:1", "b:2"]);
        let list = hint(Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("a:1".into()), string_value("c:3".into())],
            })),
        });
        assert_eq!(subset_hint(&list).unwrap(), ["a:1", "c:3"]);
        assert_eq!(subset_hint(&Metadata::default()), None);
    }
}
