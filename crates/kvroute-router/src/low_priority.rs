//! Threads that run CPU-heavy work (tokenizing long prompts) below the async
//! runtime's scheduling priority.
//!
//! Off the runtime's threads, tokenizing no longer holds up a task, but at
//! full rate it keeps every core busy, and the kernel shares each core between
//! the tokenizing threads and the runtime's: a streamed chunk or an event
//! batch waits behind a prompt. On Linux these threads put themselves in the
//! `SCHED_IDLE` class when they start (a per-thread setting): the kernel then
//! runs a runtime thread the moment it wakes, and the tokenizers get every
//! cycle nothing else in the process wants. A nice value of +10, tried first,
//! kept ~90% of a shared core for the runtime but not its wake-up latency: a
//! woken runtime thread still waited for the tokenizer's time slice, and
//! event-ingest p99 at saturation rose from ~0.4 ms idle to 1.9–4.8 ms
//! (`SCHED_IDLE`: 0.3–0.35 ms; docs/measurements/proxy-vs-nginx.md).
//!
//! `SCHED_IDLE` ranks a thread below its siblings in the same cgroup only; a
//! container's share of the machine against other containers is unchanged.
//! They are threads of their own, not tokio's blocking threads: an
//! unprivileged process cannot leave `SCHED_IDLE` again, and tokio's blocking
//! threads also run work that must not wait behind tokenizing.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, mpsc};

type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of low-priority threads taking jobs in arrival order. Dropping
/// the pool lets the threads finish the jobs queued and exit.
pub struct LowPriorityPool {
    jobs: mpsc::Sender<Job>,
}

impl LowPriorityPool {
    /// Starts `threads` threads (at least one) named `{name}-{i}`.
    pub fn new(name: &str, threads: usize) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads.max(1) {
            let queue = Arc::clone(&queue);
            std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    lower_this_threads_priority();
                    loop {
                        // The lock is held only while waiting for a job (a
                        // `while let` would hold it through the job too). Jobs
                        // catch their own panics, so it is never poisoned.
                        let next = queue.lock().expect("never poisoned").recv();
                        let Ok(job) = next else { return };
                        job();
                    }
                })?;
        }
        Ok(Self { jobs })
    }

    /// Runs `work` on one of the threads once it is free. `Err` carries the
    /// panic message if `work` panicked. `work` is told whether its caller
    /// still waits ([`Caller`]); dropping the returned future is how a caller
    /// goes away.
    pub async fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Caller) -> T + Send + 'static,
    ) -> Result<T, String> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let outcome = {
                let caller = Caller {
                    gone: &|| done.is_closed(),
                };
                std::panic::catch_unwind(AssertUnwindSafe(|| work(&caller)))
            };
            let _ = done.send(outcome);
        });
        self.jobs
            .send(job)
            .map_err(|_| "the pool's threads are gone".to_string())?;
        match result.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(panic)) => Err(panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panicked".into())),
            Err(_) => Err("the pool's thread stopped".into()),
        }
    }
}

/// Tells a job whether the caller of [`LowPriorityPool::run`] still waits for
/// its result.
pub struct Caller<'a> {
    gone: &'a dyn Fn() -> bool,
}

impl Caller<'_> {
    /// The caller's future was dropped: nobody will see the result.
    pub fn gone(&self) -> bool {
        (self.gone)()
    }
}

#[cfg(target_os = "linux")]
fn lower_this_threads_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` outlives the call. It fails
    // only where a policy forbids it; the work then runs at the usual priority.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } == -1 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "cannot lower the tokenizing threads' priority"
        );
    }
}

/// Elsewhere the work runs at the usual priority.
#[cfg(not(target_os = "linux"))]
fn lower_this_threads_priority() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    fn this_threads_policy() -> libc::c_int {
        // SAFETY: reads the calling thread's scheduling class (pid 0).
        unsafe { libc::sched_getscheduler(0) }
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn work_runs_below_the_callers_priority() {
        let pool = LowPriorityPool::new("test", 1).unwrap();
        let ours = this_threads_policy();
        assert_eq!(
            pool.run(|_| this_threads_policy()).await,
            Ok(libc::SCHED_IDLE)
        );
        assert_eq!(
            this_threads_policy(),
            ours,
            "the caller's thread is unchanged"
        );
    }

    /// Each job waits for the other to start: they finish only if both
    /// threads run at once.
    #[tokio::test]
    async fn its_threads_run_jobs_at_the_same_time() {
        let pool = LowPriorityPool::new("test", 2).unwrap();
        let (a_started, a_seen) = mpsc::channel();
        let (b_started, b_seen) = mpsc::channel();
        let a = pool.run(move |_| {
            a_started.send(()).unwrap();
            b_seen.recv().unwrap()
        });
        let b = pool.run(move |_| {
            b_started.send(()).unwrap();
            a_seen.recv().unwrap()
        });
        let both = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            tokio::join!(a, b)
        });
        assert_eq!(
            both.await,
            Ok((Ok(()), Ok(()))),
            "one job waited for the other"
        );
    }

    #[tokio::test]
    async fn a_panic_is_returned_and_the_thread_goes_on() {
        let pool = LowPriorityPool::new("test", 1).unwrap();
        let err = pool.run(|_| -> u32 { panic!("boom") }).await.unwrap_err();
        assert_eq!(err, "boom");
        assert_eq!(pool.run(|_| 7).await, Ok(7));
    }
}
