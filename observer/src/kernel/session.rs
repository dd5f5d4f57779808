//! One session around the attached probes: it owns them, their ring buffer and their
//! upkeep (the nf_tables watch, the node read again off the loop's thread after a ruleset
//! change, re-plans and their generations, interface churn, the namespace's deletion), and
//! drives the one event loop that `tail` and `agent` share. What they do with the records
//! is theirs: each is a [`Consumer`] (on record, on tick, on re-plan, on stop). A recorded
//! session ([`replay`]) drives the same calls from a `tail --record` file: `observer
//! replay` is a consumer too (`commands::replay`).
//!
//! Bounded and responsive at any load: the ring buffer is drained in batches that give the
//! loop its turn (signals and the timeout act within a batch), a consumer that is behind
//! leaves records in the ring buffer (backpressure), and every blocking read (rules, names)
//! runs on a thread of its own ([`RulesetReader`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use aya::maps::{MapData, RingBuf};
use log::warn;
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

use crate::kernel::plan::HookPlan;
use crate::kernel::probes::Probes;
use crate::kernel::upkeep::{
    RulesetReader, SOCKET_GRACE, housekeeping, legacy_tables, now_ns, replan, watch_ruleset,
};
use observer_common::traversal::end;
use observer_rules::LiveNode;

/// What a consumer wants after a record, or before a batch of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Go on.
    More,
    /// Behind: records wait in the ring buffer until the next turn.
    Wait,
    /// Stop the session, for this reason.
    Stop(&'static str),
}

/// One tick (every 100 ms), after the session's own upkeep.
pub struct Tick<'a> {
    pub probes: &'a mut Probes,
    /// The kernel's count of packets it could not record, as last read.
    pub lost_now: u64,
    /// Once a second: interfaces and the namespace were scanned (this tick).
    pub scanned: bool,
    /// Interfaces were renamed or removed: cached names are stale.
    pub names_changed: bool,
}

/// A change of the context records are read in, in the order the session handles it. A
/// live session has its probes; a recorded one (`observer replay`, [`replay`]) has none and
/// passes on what the recording kept instead.
pub enum Replan<'a> {
    /// The node was read again (off the loop's thread): rules, sets, routes, marks. The
    /// probes still run under the plan in force.
    Ruleset {
        probes: Option<&'a Probes>,
        live: &'a LiveNode,
        /// Read by the consumer's [`Consumer::light_read`]: names only, no plan or namer.
        light: bool,
        /// From a recording: the rule namer's generation and the mark names the tail used.
        recorded: Option<(u64, &'a [(u32, String)])>,
    },
    /// The probes' plan of `generation` is now in force (at start, and after a re-plan).
    Plans {
        probes: Option<&'a Probes>,
        generation: u8,
        plans: &'a [HookPlan],
    },
    /// The ruleset changed at `from` and the probes were re-planned at `to` (ns):
    /// traversals in flight between them may have missed a table.
    Replanned { from: u64, to: u64 },
    /// From a recording: interface names and kernel symbols as the following records'
    /// reports used them (a live consumer looks them up itself).
    Names {
        ifnames: &'a [(u32, String)],
        symbols: &'a [(u64, String)],
    },
}

/// The session stopped: every probe is detached and what they wrote is drained.
pub struct Stop<'a> {
    /// None at the end of a recording.
    pub probes: Option<&'a mut Probes>,
    pub why: &'static str,
    /// Records left in the ring buffer past the final drain's bound (counted, not handled).
    pub undrained: u64,
}

/// What `tail`, `agent` and `replay` do with a session's records.
pub trait Consumer {
    /// Before a batch of records: whether to take any now.
    fn ready(&mut self) -> Next {
        Next::More
    }
    /// One record, as the probes wrote it (or as the session took it from the fallback
    /// map); `lost_now` is the kernel's count of lost packets so far.
    fn on_record(&mut self, raw: &[u8], lost_now: u64) -> Next;
    /// Every tick; `Some(why)` stops the session.
    fn on_tick(&mut self, tick: Tick<'_>) -> Option<&'static str>;
    /// The ruleset changed (see [`Replan`]).
    fn on_replan(&mut self, replan: Replan<'_>);
    /// Before the node is read again after a change: a lighter read to use instead
    /// (`None`: the whole node). The agent's default mode reads names only while nobody
    /// streams (`commands::agent::names_only`).
    fn light_read(&self, _probes: &Probes) -> Option<fn() -> LiveNode> {
        None
    }
    /// After a read: whether the probes are re-planned for it (the agent's default mode has
    /// no per-table probes while nobody streams). Never after a light read.
    /// Whether the probes may be writing records now, so that the ring is drained every
    /// 10 ms; otherwise every 100 ms (a loop that wakes a hundred times a second costs an
    /// idle agent more than its reads of a large ruleset).
    fn records_flow(&self, _probes: &Probes) -> bool {
        true
    }

    fn replans(&self, _probes: &Probes) -> bool {
        true
    }
    /// The end: the probes' counters are final.
    fn on_stop(&mut self, stop: Stop<'_>);
}

pub struct SessionOptions {
    /// The observed namespace by `ip netns` name (its deletion stops the session).
    pub netns: Option<String>,
    /// Written with our pid once the signals are ours.
    pub ready_file: Option<PathBuf>,
    pub timeout: Option<Duration>,
    /// A traversal waiting in the probes' fallback map this long is handed over as
    /// incomplete.
    pub idle: Duration,
    /// Records handled before the loop looks at signals and timers again.
    pub batch: usize,
    /// At exit, how long the remaining records are still handed over; the rest are counted.
    pub final_drain: Duration,
}

pub struct Session {
    probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    opts: SessionOptions,
    lost_now: u64,
}

impl Session {
    /// Takes the attached probes and their ring buffer.
    pub fn new(mut probes: Probes, opts: SessionOptions) -> Result<Self> {
        let ring = probes.take_ring()?;
        // SAFETY: the ring buffer owns its fd and outlives the registration (both live here).
        let ring = unsafe { AsyncFd::register(ring) }
            .map_err(|e| anyhow::anyhow!("polling the ring buffer: {e}"))?;
        Ok(Self {
            probes,
            ring,
            opts,
            lost_now: 0,
        })
    }

    pub fn probes(&self) -> &Probes {
        &self.probes
    }

    pub fn probes_mut(&mut self) -> &mut Probes {
        &mut self.probes
    }

    /// Runs the event loop until a signal, the timeout, the namespace's deletion or the
    /// consumer stops it; then stops the probes, hands over what they still hold, and calls
    /// [`Consumer::on_stop`]. Returns why it stopped.
    pub async fn run<C: Consumer>(mut self, c: &mut C) -> Result<&'static str> {
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sighup = signal(SignalKind::hangup())?;
        // Ready only once the signals are ours: from now on a signal ends the session with
        // its summary.
        if let Some(path) = &self.opts.ready_file {
            std::fs::write(path, format!("{}\n", std::process::id()))
                .with_context(|| format!("writing ready file {}", path.display()))?;
        }
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        // The probes wake us only when the ring buffer fills; otherwise we drain it on this
        // timer.
        let mut drain_tick = tokio::time::interval(Duration::from_millis(10));
        drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let deadline = self.opts.timeout.map(|t| Instant::now() + t);
        let netns_file = self
            .opts
            .netns
            .as_ref()
            .map(|n| crate::kernel::netns::path(n));
        let netns_inode = crate::kernel::netns::current_netns_inode()?;
        let mut legacy_names = legacy_tables().0;
        let mut last_scan = Instant::now();
        // nf_tables changes: new base chains are bracketed within a second of appearing.
        let watch = watch_ruleset();
        let mut ruleset = RulesetReader::default();
        let batch = self.opts.batch;
        let why: &'static str = loop {
            tokio::select! {
                biased;
                _ = sigint.recv() => break "SIGINT",
                _ = sigterm.recv() => break "SIGTERM",
                _ = sighup.recv() => break "SIGHUP",
                _ = tokio::time::sleep_until(deadline.map_or_else(
                    || tokio::time::Instant::now() + Duration::from_secs(3600),
                    tokio::time::Instant::from_std)), if deadline.is_some() => break "--timeout",
                guard = async { watch.as_ref().expect("guarded").readable().await }, if watch.is_some() => {
                    let mut guard = guard?;
                    if guard.get_inner().drain() {
                        ruleset.changed();
                    }
                    guard.clear_ready();
                }
                _ = tick.tick() => {
                    if !c.records_flow(&self.probes) {
                        let (_, stop) = drain(self.ring.get_mut(), c, self.lost_now, batch);
                        if let Some(why) = stop { break why; }
                    }
                    self.probes.flush_log();
                    let light = c.light_read(&self.probes);
                    if let Some((since, live, light)) = ruleset.poll_with(light) {
                        // Tracing began during a light read: a whole read follows for the
                        // plan and the namers.
                        if light && self.probes.tracing() {
                            ruleset.changed();
                        }
                        c.on_replan(Replan::Ruleset { probes: Some(&self.probes), live: &live, light, recorded: None });
                        if !light && c.replans(&self.probes) && replan(&mut self.probes, &live) {
                            let probes = &self.probes;
                            c.on_replan(Replan::Plans { probes: Some(probes), generation: probes.generation(), plans: &probes.plans });
                            c.on_replan(Replan::Replanned { from: since, to: now_ns() });
                        }
                    }
                    self.lost_now = self.probes.counters().map(|k| k.ringbuf_full).unwrap_or(self.lost_now);
                    let now = now_ns();
                    let before = (
                        now.saturating_sub(SOCKET_GRACE.as_nanos() as u64),
                        now.saturating_sub(self.opts.idle.as_nanos() as u64),
                    );
                    if let Some(why) = self.take_waiting(c, before, end::IDLE) {
                        break why;
                    }
                    let mut t = Tick { probes: &mut self.probes, lost_now: self.lost_now, scanned: false, names_changed: false };
                    if last_scan.elapsed() >= Duration::from_secs(1) {
                        last_scan = Instant::now();
                        let h = housekeeping(t.probes, netns_file.as_deref(), netns_inode);
                        if let Some(why) = h.stop {
                            break why;
                        }
                        t.scanned = true;
                        t.names_changed = h.names_changed;
                        // Legacy x_tables announce nothing: a table loaded since is seen here.
                        let legacy = legacy_tables().0;
                        if legacy != legacy_names {
                            legacy_names = legacy;
                            ruleset.changed();
                        }
                    }
                    if let Some(why) = c.on_tick(t) {
                        break why;
                    }
                }
                guard = self.ring.readable_mut() => {
                    let mut guard = guard?;
                    let (n, stop) = drain(guard.get_inner_mut(), c, self.lost_now, batch);
                    if n < batch {
                        guard.clear_ready();
                    }
                    if let Some(why) = stop { break why; }
                }
                _ = drain_tick.tick(), if c.records_flow(&self.probes) => {
                    let (_, stop) = drain(self.ring.get_mut(), c, self.lost_now, batch);
                    if let Some(why) = stop { break why; }
                }
            }
        };
        self.stop(c, why);
        Ok(why)
    }

    /// Hands over the fallback-map traversals the probes give up: a socket's held since
    /// before `before.0` as delivered, any other not heard of since `before.1` ending as
    /// `idle_end`.
    fn take_waiting<C: Consumer>(
        &mut self,
        c: &mut C,
        before: (u64, u64),
        idle_end: u8,
    ) -> Option<&'static str> {
        match self.probes.sweep(before.0, before.1, idle_end) {
            Ok(recs) => {
                // Taken out of the map: every one is handed over (a consumer that has
                // stopped counts them), whatever the first one's answer.
                let mut stop = None;
                for r in &recs {
                    if let Next::Stop(why) = c.on_record(r.written_bytes(), self.lost_now) {
                        stop.get_or_insert(why);
                    }
                }
                stop
            }
            Err(e) => {
                warn!("reading the probes' fallback map: {e:#}");
                None
            }
        }
    }

    /// Nothing more comes in from here: what the probes hold now is all there is to account.
    fn stop<C: Consumer>(mut self, c: &mut C, why: &'static str) {
        // Every probe is told at once to stop (the floor flag) before any is detached, so
        // that no traversal is written with some of its probes already gone; one still on
        // its way stays in its slot and is counted as in flight. (A probe already running on
        // another CPU when the flag is set finishes within microseconds; 10 ms covers a
        // preempted one.)
        let stopping = Instant::now();
        if let Err(e) = self.probes.set_floor(true) {
            warn!("stopping the probes: {e:#}");
        }
        let releasing = self.probes.detach();
        self.probes.flush_log();
        log::debug!("exit: probes detached after {:?}", stopping.elapsed());
        std::thread::sleep(Duration::from_millis(10));
        // What the probes wrote before we stopped is still owed, within a bound: under a
        // flood the ring buffer holds more than can be handled promptly. Traversals waiting
        // in the fallback map are handed over too, as still in flight (a socket's as
        // delivered); only those in per-CPU slots, which the probes may still be writing,
        // are just counted.
        self.take_waiting(c, (u64::MAX, u64::MAX), end::IN_FLIGHT);
        let until = Instant::now() + self.opts.final_drain;
        let ring = self.ring.get_mut();
        while Instant::now() < until {
            let (n, stop) = drain(ring, c, self.lost_now, 256);
            if stop.is_some() || (n == 0 && c.ready() != Next::Wait) {
                break;
            }
        }
        log::debug!("exit: ring buffer drained after {:?}", stopping.elapsed());
        // Counted, not handed over (the probes are detached: the ring buffer only empties).
        let mut undrained = 0;
        while ring.next().is_some() {
            undrained += 1;
        }
        c.on_stop(Stop {
            probes: Some(&mut self.probes),
            why,
            undrained,
        });
        let _ = releasing.join();
        log::debug!(
            "exit: counted, links released after {:?}",
            stopping.elapsed()
        );
    }
}

/// Hands up to `max` records to `c`; returns how many were read and why to stop, if so.
fn drain<C: Consumer>(
    ring: &mut RingBuf<MapData>,
    c: &mut C,
    lost_now: u64,
    max: usize,
) -> (usize, Option<&'static str>) {
    match c.ready() {
        Next::More => {}
        Next::Wait => return (0, None),
        Next::Stop(why) => return (0, Some(why)),
    }
    let mut n = 0;
    while n < max {
        let Some(item) = ring.next() else { break };
        n += 1;
        match c.on_record(&item, lost_now) {
            Next::More => {}
            Next::Wait => break,
            Next::Stop(why) => return (n, Some(why)),
        }
    }
    // The consumer's turn after the batch (tail hands its reports to the writer).
    match c.ready() {
        Next::Stop(why) => (n, Some(why)),
        _ => (n, None),
    }
}
