//! kvroute-cluster: router replicas that share their workers' events and
//! registrations through NATS JetStream, so that any replica can take any
//! worker's stream and every replica routes on the same index.
//!
//! The router's side is the seam in `kvroute_router::replica`: a held stream
//! appends its records to the [`log`] instead of applying them, and every
//! replica applies the one stream of records in order ([`follow`]).
//! Registrations live in a KV bucket with a TTL ([`registrations`]), and
//! so do agent sessions' bindings ([`sessions`]). Replicas'
//! bookings and predictions go over core NATS ([`load`]). Index snapshots in
//! an object store let a replica start without replaying the whole stream,
//! and the stream forget what they cover ([`snapshot`]). Without
//! `[cluster]` in the config nothing here runs. DESIGN.md beside this crate
//! says what is ordered, acked and de-duplicated, and what can race.

pub mod error;
pub mod follow;
pub mod load;
pub mod log;
pub mod record;
pub mod registrations;
pub mod sessions;
pub mod snapshot;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use kvroute_router::Config;
use kvroute_router::replica::Replica;
use kvroute_router::server::{self, Running};

pub use error::ClusterError;

/// Connects to NATS, makes sure the stream and the bucket exist, and starts a
/// router replica on them.
pub async fn start(config: Config) -> Result<Running, ClusterError> {
    let cluster = config.cluster.clone();
    let replica_id = if cluster.replica_id.is_empty() {
        host_name()
    } else {
        cluster.replica_id.clone()
    };
    let client = async_nats::ConnectOptions::new()
        .name(format!("kvroute {replica_id}"))
        // Past the first connection the client reconnects by itself, for ever.
        .max_reconnects(None)
        .connect(&cluster.nats_url)
        .await
        .map_err(|e| ClusterError::Connect {
            url: cluster.nats_url.clone(),
            message: e.to_string(),
        })?;
    let mut js = jetstream::new(client.clone());
    js.set_timeout(Duration::from_secs(5));
    js.get_or_create_stream(stream::Config {
        name: record::STREAM.into(),
        subjects: record::SUBJECTS.iter().map(|s| s.to_string()).collect(),
        max_age: Duration::from_secs(cluster.stream_max_age_s),
        max_bytes: cluster.stream_max_bytes,
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    })
    .await
    .map_err(ClusterError::jetstream)?;
    let ttl = Duration::from_millis(cluster.registration_ttl_ms);
    let kv = registrations::bucket(&js, ttl).await?;
    let session_ttl = Duration::from_secs(config.sessions.ttl_s);
    let sessions_kv = match config.sessions.header()? {
        Some(_) => Some(sessions::bucket(&js, session_ttl).await?),
        None => None,
    };
    let snapshots = Arc::new(
        snapshot::Snapshots::open(
            &js,
            &replica_id,
            Duration::from_secs(cluster.snapshot_interval_s),
            Duration::from_secs(cluster.stream_max_age_s),
        )
        .await?,
    );

    let log = log::NatsLog::new(
        client.clone(),
        js.clone(),
        kv.clone(),
        replica_id.clone(),
        ttl,
    );
    let replica = Arc::new(Replica::new(Arc::new(log), replica_id.clone()));
    tracing::info!(replica = %replica_id, url = %cluster.nats_url, "joining the cluster");
    let mut running = server::start_replica(config, Arc::clone(&replica)).await?;
    let state = Arc::clone(&running.state);
    let stopped = running.stopped();
    let (captures, captured) = tokio::sync::mpsc::channel(1);
    running.add_task(tokio::spawn(follow::follow(
        js,
        Arc::clone(&state),
        Arc::clone(&snapshots),
        captured,
        stopped.clone(),
    )));
    running.add_task(tokio::spawn(snapshots.run(
        Arc::clone(&replica),
        captures,
        stopped.clone(),
    )));
    if let Some(sessions_kv) = sessions_kv {
        for task in sessions::share(
            sessions_kv,
            Arc::clone(&state),
            replica_id.clone(),
            stopped.clone(),
        ) {
            running.add_task(task);
        }
    }
    running.add_task(tokio::spawn(registrations::watch(
        kv,
        Arc::clone(&state),
        replica_id,
        stopped.clone(),
    )));
    running.add_task(tokio::spawn(follow::watch_peer_digests(
        client.clone(),
        Arc::clone(&replica),
        stopped.clone(),
    )));
    if cluster.share_load {
        for task in load::share(client.clone(), Arc::clone(&state), stopped.clone()).await? {
            running.add_task(task);
        }
    }
    running.add_task(tokio::spawn(follow::watch_connection(
        client, replica, stopped,
    )));
    Ok(running)
}

/// The default `replica_id`: the host name (a pod's name under Kubernetes).
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kvroute".into())
}
