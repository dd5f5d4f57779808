//! What `tail` and `agent` share around the probes: attaching them once in the observed
//! namespace (the mark dictionary, the hooks' users, the probe plan), and keeping them right
//! while the ruleset and the interfaces change (re-plans, interface sync, the namespace's
//! deletion). Callers own the pipelines: these functions say what changed, callers update.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use log::{info, warn};

use crate::kernel::btf::KernelLayout;
use crate::kernel::nf_link::{NfFamily, NfHook};
use crate::kernel::plan::{base_chains, full_plan, legacy_users};
use crate::kernel::probes::Probes;
use observer_common::filter::FilterProgram;
use observer_model::marks::MarkDictionary;
use observer_rules::LiveNode;

/// After an nf_tables change, how long to wait for more before re-planning (a restore
/// comes as a burst of messages).
pub const RULESET_SETTLE: Duration = Duration::from_millis(100);

/// A socket had the packet this long ago, and it was neither dropped nor freed since: it
/// was delivered (queued, or freed by TCP without an event).
pub const SOCKET_GRACE: Duration = Duration::from_millis(50);

/// Reads the node's rules, sets, routes and addresses, warning about every read that
/// failed (rule naming then says undecidable where it needed what is missing).
pub fn read_live() -> LiveNode {
    let live = LiveNode::read();
    for e in &live.failures {
        warn!("reading the node: {e}");
    }
    live
}

/// The mark dictionary for this run: defaults, then the bits the live ruleset shows
/// (KUBE-MARK-MASQ / KUBE-MARK-DROP, or nftables mode's mark-for-masquerade), then the
/// user's file.
pub fn mark_dictionary(live: &LiveNode, file: Option<&PathBuf>) -> Result<MarkDictionary> {
    let mut d = MarkDictionary::default();
    for (bit, name) in live.learn_marks(&mut d) {
        info!("live ruleset: {name} is {bit:#x}");
    }
    if let Some(f) = file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading marks file {}", f.display()))?;
        d.apply_toml(&text)
            .with_context(|| format!("in marks file {}", f.display()))?;
    }
    Ok(d)
}

/// Loads the probes with `program` as their filter and attaches them to every hook user
/// (as `live` shows them) and interface of the current namespace (the caller has entered
/// it).
pub fn attach_probes(
    layout: &KernelLayout,
    program: &FilterProgram,
    live: &LiveNode,
    floor: bool,
) -> Result<Probes> {
    let mut probes = Probes::load(layout, program)?;
    if let Some(why) = probes.capture_refused() {
        anyhow::bail!(
            "{why}\nstill works on this kernel: `observer agent` in its default mode (every \
             rule's and conntrack's counters, drops by reason) and `observer explain --live` \
             (the path predicted from the live rules)"
        );
    }
    // Before anything is attached: the benchmark's floor records nothing at all.
    probes.set_floor(floor)?;
    let users = hook_users(live);
    probes.attach_points(full_plan(users.as_deref()))?;
    let changes = probes.sync_interfaces()?;
    for (name, e) in &changes.failed {
        warn!("no probes on interface {name}: {e}");
    }
    info!(
        "attached {} per-table probes (capture: {}) and tcx on {}",
        probes.attachments(),
        probes.capture_backend().name(),
        changes.added.join(", ")
    );
    Ok(probes)
}

/// Loads the probes to keep the always-on counters (`observer agent`) and attaches them to
/// every hook user of the current namespace; no tcx until traversals are wanted.
pub fn attach_counting(layout: &KernelLayout, live: &LiveNode, floor: bool) -> Result<Probes> {
    let mut probes = Probes::load_counting(layout)?;
    probes.set_floor(floor)?;
    let users = hook_users(live);
    probes.attach_points(full_plan(users.as_deref()))?;
    info!(
        "attached {} per-table probes (capture: {}), counting",
        probes.attachments(),
        probes.capture_backend().name()
    );
    Ok(probes)
}

/// What runs at each netfilter hook of the namespace: the base chains of its nf_tables
/// ruleset (native and iptables-nft) and its legacy x_tables. `None` when the ruleset could
/// not be read (the reader said why): then every standard table is bracketed.
pub fn hook_users(live: &LiveNode) -> Option<Vec<(NfFamily, NfHook, i32)>> {
    let Some(nft) = live.ruleset.nft.as_ref() else {
        warn!("no nftables ruleset read: bracketing every standard table");
        return None;
    };
    let mut users = base_chains(nft);
    users.extend(legacy_tables().1);
    // IPVS translates replies back at FORWARD (ip_vs_out_hook, priority 100): bracketed
    // like a table where the node has virtual services (its requests show where INPUT
    // meets OUTPUT, see the report).
    if !live.ipvs.is_empty() {
        for family in [NfFamily::Ipv4, NfFamily::Ipv6] {
            users.push((family, NfHook::Forward, IPVS_FORWARD));
        }
    }
    Some(users)
}

pub use crate::kernel::plan::IPVS_FORWARD;

/// The legacy x_tables of the namespace (the process is in it): their names as read, and
/// where they run. No file: none loaded.
pub fn legacy_tables() -> (String, Vec<(NfFamily, NfHook, i32)>) {
    let mut names = String::new();
    let mut users = Vec::new();
    for (family, file) in [
        (NfFamily::Ipv4, "/proc/net/ip_tables_names"),
        (NfFamily::Ipv6, "/proc/net/ip6_tables_names"),
    ] {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        users.extend(legacy_users(family, &text));
        names.push_str(&text);
        names.push('/');
    }
    (names, users)
}

/// The agent's default mode: only the drop tracepoint (it runs when a packet is dropped,
/// never for every packet); no netfilter or tcx probe until [`attach_brackets`].
pub fn attach_drops_only(layout: &KernelLayout, floor: bool) -> Result<Probes> {
    // Traversals are recorded only while a client streams, with a filter: 4 MiB of ring
    // (lost records are counted) instead of 16 MiB resident all the time.
    let mut probes = Probes::load_counting_with_ring(layout, Some(4 * 1024 * 1024))?;
    probes.set_floor(floor)?;
    info!("attached the drop tracepoint only: no probe runs for every packet");
    Ok(probes)
}

/// The agent's default mode, while a client streams: the per-table probes of the tables
/// the node has now.
/// Returns the node as read for it.
pub fn attach_brackets(probes: &mut Probes) -> Result<LiveNode> {
    let live = read_live();
    probes.attach_points(full_plan(hook_users(&live).as_deref()))?;
    info!(
        "attached {} per-table probes (capture: {}) for the streaming clients",
        probes.attachments(),
        probes.capture_backend().name()
    );
    Ok(live)
}

/// Brackets the tables the node has now (`live`, read after a change); true when the plan
/// changed (the caller hands the new plans to its pipelines).
pub fn replan(probes: &mut Probes, live: &LiveNode) -> bool {
    let users = hook_users(live);
    match probes.replan(full_plan(users.as_deref())) {
        Ok(changed) if changed.is_empty() => false,
        Ok(changed) => {
            let hooks: Vec<String> = changed
                .iter()
                .map(|(f, h)| format!("{}/{}", f.name(), h.name()))
                .collect();
            info!("ruleset changed: probes re-planned on {}", hooks.join(", "));
            true
        }
        Err(e) => {
            probes.attach_failures += 1;
            warn!("re-planning the per-table probes after a ruleset change failed: {e:#}");
            false
        }
    }
}

/// What one housekeeping pass found.
#[derive(Debug, Default)]
pub struct Housekeeping {
    /// Interfaces were renamed or removed: cached names are stale.
    pub names_changed: bool,
    /// Why to stop, if so (the observed namespace was deleted).
    pub stop: Option<&'static str>,
}

/// Once a second: interfaces and the namespace.
pub fn housekeeping(
    probes: &mut Probes,
    netns_file: Option<&Path>,
    netns_inode: u64,
) -> Housekeeping {
    let mut out = Housekeeping::default();
    match probes.sync_interfaces() {
        Ok(c) => {
            if !c.added.is_empty() {
                info!("tcx attached on new interfaces {}", c.added.join(", "));
            }
            for name in &c.removed {
                info!("interface {name} is gone; its probes are released");
            }
            for (old, new) in &c.renamed {
                info!("interface {old} is now called {new}");
            }
            for (name, e) in &c.failed {
                warn!("no probes on interface {name}: {e}");
            }
            out.names_changed = !c.removed.is_empty() || !c.renamed.is_empty();
        }
        Err(e) => warn!("scanning interfaces: {e:#}"),
    }
    if let Some(file) = netns_file {
        use std::os::unix::fs::MetadataExt;
        let same = std::fs::metadata(file).is_ok_and(|m| m.ino() == netns_inode);
        if !same {
            warn!(
                "the observed namespace {} was deleted; stopping",
                file.display()
            );
            out.stop = Some("namespace deleted");
        }
    }
    out
}

/// CLOCK_MONOTONIC in ns, the clock `bpf_ktime_get_ns` reads.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Watches the namespace's nf_tables changes; `None` (said once) when it cannot, and then
/// chains added later are not bracketed.
pub fn watch_ruleset() -> Option<tokio::io::unix::AsyncFd<crate::kernel::nftwatch::NftWatch>> {
    // SAFETY: the watch owns its fd and outlives the registration (both are returned).
    match crate::kernel::nftwatch::NftWatch::open().and_then(|w| {
        unsafe { tokio::io::unix::AsyncFd::register(w) }
            .map_err(|e| std::io::Error::other(e.to_string()))
    }) {
        Ok(w) => Some(w),
        Err(e) => {
            warn!("cannot watch nf_tables changes ({e}); chains added later are not bracketed");
            None
        }
    }
}

/// Reads the node again after a ruleset change, once the change has settled
/// ([`RULESET_SETTLE`]), on a thread of its own (several commands, a few hundred ms on a
/// large ruleset): the caller's event loop keeps draining meanwhile. The thread is in the
/// observed namespace, as every thread started after `netns::enter`.
#[derive(Default)]
pub struct RulesetReader {
    /// When the first change not read yet happened (ns).
    changed: Option<u64>,
    /// A read under way, the change it is for, and whether it is a light one.
    reading: Option<(u64, std::sync::mpsc::Receiver<LiveNode>, bool)>,
}

impl RulesetReader {
    /// The ruleset changed (now).
    pub fn changed(&mut self) {
        self.changed.get_or_insert_with(now_ns);
    }

    /// Once per tick: starts a read when a change has settled; returns the node as read,
    /// with when the change happened (ns), once the read is done.
    pub fn poll(&mut self) -> Option<(u64, LiveNode)> {
        self.poll_with(None).map(|(since, live, _)| (since, live))
    }

    /// As [`RulesetReader::poll`]; a read started now uses `light` instead of the whole
    /// node when given. Says whether the node returned was read by `light`.
    pub fn poll_with(&mut self, light: Option<fn() -> LiveNode>) -> Option<(u64, LiveNode, bool)> {
        if self.reading.is_none()
            && let Some(since) = self.changed
            && now_ns().saturating_sub(since) >= RULESET_SETTLE.as_nanos() as u64
        {
            self.changed = None;
            let (tx, rx) = std::sync::mpsc::channel();
            let read = light.unwrap_or(read_live);
            std::thread::spawn(move || {
                let _ = tx.send(read());
            });
            self.reading = Some((since, rx, light.is_some()));
        }
        let (since, rx, is_light) = self.reading.as_ref()?;
        match rx.try_recv() {
            Ok(live) => {
                let (since, is_light) = (*since, *is_light);
                self.reading = None;
                Some((since, live, is_light))
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => None,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                warn!("reading the node after a ruleset change failed: its thread ended early");
                self.reading = None;
                None
            }
        }
    }
}
