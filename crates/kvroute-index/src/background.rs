//! The index's own background threads (the recency thread, the predicted
//! layer's spare tables), started so that waking one never preempts the
//! request that woke it.
//!
//! A lookup or a record wakes them from the routing decision's path. Woken as
//! ordinary threads, the kernel often ran them at once on the waker's core, and
//! on a busy machine the decision then waited a time slice (0.3–12 ms) for its
//! core back: that was most of the 8k-token decision's p99 on the shared
//! 2-core bench machine (docs/measurements/index-vs-dynamo.md, "Layout choices"). On Linux they run in
//! `SCHED_BATCH`: the same share of the CPU as any thread of the process, but a
//! wake-up never preempts a running thread; they start on an idle core at once,
//! or at the running thread's next tick. (`SCHED_IDLE`, as the tokenizing
//! threads use, would let them starve under load, and lookups would then apply
//! the touches themselves.)

/// Starts `work` on a thread named `name` in `SCHED_BATCH`; `None` if no
/// thread can be started.
pub(crate) fn spawn(name: &str, work: impl FnOnce() + Send + 'static) -> Option<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            no_wakeup_preemption();
            work();
        })
        .ok()
        .map(drop)
}

#[cfg(target_os = "linux")]
fn no_wakeup_preemption() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` outlives the call. It fails
    // only where a policy forbids it; the thread then runs as an ordinary one.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
}

/// Elsewhere the threads run as ordinary ones.
#[cfg(not(target_os = "linux"))]
fn no_wakeup_preemption() {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn background_threads_run_in_the_batch_class() {
        let (policy, seen) = std::sync::mpsc::channel();
        super::spawn("test", move || {
            // SAFETY: reads the calling thread's scheduling class (pid 0).
            let _ = policy.send(unsafe { libc::sched_getscheduler(0) });
        })
        .unwrap();
        assert_eq!(seen.recv().unwrap(), libc::SCHED_BATCH);
        // SAFETY: as above, for the test's own thread.
        assert_ne!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_BATCH);
    }
}
