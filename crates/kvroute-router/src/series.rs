//! Prometheus series that go away with their worker.
//!
//! The `metrics` facade cannot delete a series, and the Prometheus exporter
//! keeps every series it was given: a purged or removed worker's breaker state,
//! in-flight gauges and counters would stay on `/metrics` for ever, frozen at
//! their last values. What the exporter can do is drop series that have not
//! changed for an idle timeout. [`Expiring`] turns that into deletion on demand:
//! it sits between the facade and the exporter and keeps every counter and
//! gauge it hands out; right before each render it *touches* (adds zero to)
//! every one it still keeps. With an idle timeout of zero, what the exporter
//! deletes at a render is then exactly what was not touched: the series that
//! [`Renderer::forget_worker`] took off the list. A series registered again
//! later (the worker came back) is kept and touched again.
//!
//! Why this is sound: renders and registrations take the same lock, so no handle
//! is given out for a series the same render deletes; and the registry forgets a
//! worker under its own lock, in the same step that drops the worker's entries,
//! so handles a newer registration of the worker holds were registered after the
//! forgetting and are kept. Every render must go through [`Renderer::render`]:
//! rendering the exporter directly would delete live series. Histograms carry no
//! worker label and never expire.
//!

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};

#[derive(Default)]
struct Kept {
    counters: HashMap<Key, Counter>,
    gauges: HashMap<Key, Gauge>,
}

/// The recorder installed in front of the Prometheus exporter's.
pub struct Expiring {
    inner: PrometheusRecorder,
    kept: Arc<RwLock<Kept>>,
}

/// Renders `/metrics` and forgets workers' series.
#[derive(Clone)]
pub struct Renderer {
    prometheus: PrometheusHandle,
    kept: Arc<RwLock<Kept>>,
}

impl Expiring {
    /// `inner` must be built with an idle timeout of zero for counters and
    /// gauges.
    pub fn new(inner: PrometheusRecorder) -> (Self, Renderer) {
        let kept = Arc::default();
        let renderer = Renderer {
            prometheus: inner.handle(),
            kept: Arc::clone(&kept),
        };
        (Self { inner, kept }, renderer)
    }
}

impl Recorder for Expiring {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if let Some(counter) = read(&self.kept).counters.get(key) {
            return counter.clone();
        }
        write(&self.kept)
            .counters
            .entry(key.clone())
            .or_insert_with(|| self.inner.register_counter(key, metadata))
            .clone()
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if let Some(gauge) = read(&self.kept).gauges.get(key) {
            return gauge.clone();
        }
        write(&self.kept)
            .gauges
            .entry(key.clone())
            .or_insert_with(|| self.inner.register_gauge(key, metadata))
            .clone()
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.inner.register_histogram(key, metadata)
    }
}

impl Renderer {
    /// The exposition text; series forgotten since the last render are left out
    /// (at the latest from the render after, if they changed in between).
    pub fn render(&self) -> String {
        let kept = write(&self.kept);
        for counter in kept.counters.values() {
            counter.increment(0);
        }
        for gauge in kept.gauges.values() {
            gauge.increment(0.0);
        }
        self.prometheus.render()
    }

    /// Lets every series labelled with `worker_id` (`worker="7"`, or a rank's
    /// `worker="7:1"`) go at the next render.
    pub fn forget_worker(&self, worker_id: u64) {
        let id = worker_id.to_string();
        let of_worker = |key: &Key| {
            key.labels().any(|label| {
                label.key() == "worker" && label.value().split(':').next() == Some(id.as_str())
            })
        };
        let mut kept = write(&self.kept);
        kept.counters.retain(|key, _| !of_worker(key));
        kept.gauges.retain(|key, _| !of_worker(key));
    }
}

fn read(kept: &RwLock<Kept>) -> std::sync::RwLockReadGuard<'_, Kept> {
    kept.read().unwrap_or_else(PoisonError::into_inner)
}

fn write(kept: &RwLock<Kept>) -> std::sync::RwLockWriteGuard<'_, Kept> {
    kept.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use metrics_exporter_prometheus::PrometheusBuilder;
    use metrics_util::MetricKindMask;

    use super::*;

    #[test]
    fn a_forgotten_workers_series_go_and_the_rest_stay() {
        let inner = PrometheusBuilder::new()
            .idle_timeout(
                MetricKindMask::COUNTER | MetricKindMask::GAUGE,
                Some(std::time::Duration::ZERO),
            )
            .build_recorder();
        let (recorder, renderer) = Expiring::new(inner);
        metrics::with_local_recorder(&recorder, || {
            // A handle held across renders, as the registry holds its gauges.
            let held = metrics::gauge!("g", "worker" => "2");
            held.set(5.0);
            metrics::counter!("c", "worker" => "1").increment(3);
            metrics::gauge!("g", "worker" => "1:1").set(1.0);
            metrics::counter!("c").increment(1);
            assert!(renderer.render().contains("worker=\"1"));

            renderer.forget_worker(1);
            for _ in 0..3 {
                let text = renderer.render();
                assert!(!text.contains("worker=\"1"), "{text}");
                assert!(text.contains("g{worker=\"2\"} 5"), "{text}");
                assert!(text.contains("c 1"), "{text}");
            }
            held.set(6.0);
            assert!(renderer.render().contains("g{worker=\"2\"} 6"));

            // The worker came back: its series do too, and stay.
            metrics::counter!("c", "worker" => "1").increment(1);
            for _ in 0..2 {
                assert!(renderer.render().contains("c{worker=\"1\"} 1"));
            }
        });
    }
}
