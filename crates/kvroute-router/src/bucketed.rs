//! Histograms with fixed buckets, counted where they are recorded.
//!
//! The Prometheus exporter's histogram reads its own clock for each sample
//! and pushes the sample, with the time, into a lock-free queue (pinning an
//! epoch), and a later render or upkeep drains the queue into the buckets:
//! about 170 instructions a sample, and a small request records eight. A
//! bucketed family needs neither the time nor the samples, only counts, so a
//! [`Bucketed`] histogram adds the sample to its count, its sum and its bucket
//! at once, and renders the lines the exporter would have rendered for it.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{HistogramFn, Key};
use metrics_exporter_prometheus::LabelSet;
use metrics_exporter_prometheus::formatting::{
    sanitize_metric_name, write_help_line, write_metric_line, write_type_line,
};

/// One series' counts.
pub struct Bucketed {
    /// Upper bounds, ascending.
    bounds: &'static [f64],
    /// Samples per bucket, each counted once: in the first bucket whose bound
    /// it does not exceed (none for a sample above every bound, or NaN).
    in_bucket: Box<[AtomicU64]>,
    count: AtomicU64,
    /// The samples' sum, as `f64` bits.
    sum: AtomicU64,
}

impl Bucketed {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            in_bucket: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Cumulative counts per bound, then the count and the sum. A sample is
    /// counted before it is put in its bucket and the buckets are read first,
    /// so no bucket's cumulative count exceeds the count while samples come in.
    fn snapshot(&self) -> (Vec<u64>, u64, f64) {
        let mut below = 0;
        let cumulative = self
            .in_bucket
            .iter()
            .map(|n| {
                below += n.load(Ordering::Acquire);
                below
            })
            .collect();
        let count = self.count.load(Ordering::Acquire);
        (
            cumulative,
            count,
            f64::from_bits(self.sum.load(Ordering::Relaxed)),
        )
    }
}

impl HistogramFn for Bucketed {
    fn record(&self, value: f64) {
        self.count.fetch_add(1, Ordering::AcqRel);
        let _ = self
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |sum| {
                Some((f64::from_bits(sum) + value).to_bits())
            });
        // As the exporter counts: in every bucket whose bound is not below the
        // sample (so NaN in none).
        let at = if value.is_nan() {
            self.bounds.len()
        } else {
            self.bounds.partition_point(|&bound| bound < value)
        };
        if let Some(bucket) = self.in_bucket.get(at) {
            bucket.fetch_add(1, Ordering::Release);
        }
    }
}

/// Renders one family as the exporter does: its help line if described, its
/// type line, each series' buckets, `+Inf`, sum and count, and a blank line.
pub fn render_family(
    out: &mut String,
    name: &str,
    help: Option<&str>,
    series: &[(&Key, &Bucketed)],
) {
    let name = sanitize_metric_name(name);
    if let Some(help) = help {
        write_help_line(out, &name, None, None, help);
    }
    write_type_line(out, &name, None, None, "histogram");
    for &(key, histogram) in series {
        let labels = LabelSet::from_key_and_global(key, &Default::default());
        let (cumulative, count, sum) = histogram.snapshot();
        for (bound, n) in histogram.bounds.iter().zip(cumulative) {
            write_metric_line(
                out,
                &name,
                Some("bucket"),
                &labels,
                Some(("le", bound)),
                n,
                None,
            );
        }
        write_metric_line(
            out,
            &name,
            Some("bucket"),
            &labels,
            Some(("le", "+Inf")),
            count,
            None,
        );
        write_metric_line::<&str, f64>(out, &name, Some("sum"), &labels, None, sum, None);
        write_metric_line::<&str, u64>(out, &name, Some("count"), &labels, None, count, None);
    }
    let _ = out.write_char('\n');
}
