//! Capture backends: how the per-table probes reach the points of the plan
//! ([`crate::kernel::plan`]). The plan says where to observe (a point before a hook's first
//! table and one after each table); a backend puts a probe program there and says which
//! points it holds. Everything else (the shared maps, the plan generation, which probes read
//! the headers again, the records and what is made of them) is the same whichever backend
//! captures, so the session, the pipeline and the reports never ask which one it is.
//!
//! - [`links`]: BPF netfilter links (`BPF_PROG_TYPE_NETFILTER`, Linux 6.4+), one link per
//!   point, at the point's own priority.
//! - [`fentry`]: fentry/fexit trampolines on the functions the tables run (`nft_do_chain`,
//!   `ipt_do_table`, conntrack's and NAT's entry points), for kernels that refuse netfilter
//!   programs (6.1).
//!
//! [`choose`] is the one place that picks a backend.

pub mod fentry;
pub mod links;

use std::collections::HashMap;
use std::os::fd::RawFd;

use crate::kernel::btf::KernelLayout;
use crate::kernel::nf_link::{NfFamily, NfHook};
use crate::kernel::plan::HookPlan;

/// The capture backends observer knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// BPF netfilter links ([`links`]).
    Links,
    /// fentry/fexit trampolines on the tables' functions ([`fentry`]).
    Fentry,
}

impl BackendKind {
    pub const ALL: [BackendKind; 2] = [BackendKind::Links, BackendKind::Fentry];

    /// As the user names it (`--backend`, the agent's `backend` label).
    pub fn label(self) -> &'static str {
        match self {
            BackendKind::Links => "links",
            BackendKind::Fentry => "fentry",
        }
    }

    /// What it attaches, for messages.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Links => "netfilter links",
            BackendKind::Fentry => "fentry trampolines",
        }
    }

    /// Whether this backend can capture on this kernel, and if not, why (said before
    /// anything is attached). Cheap: at most one trivial program loaded and released.
    pub fn can_run(self, layout: &KernelLayout) -> Result<(), Unsupported> {
        match self {
            BackendKind::Links => links::can_run(layout),
            BackendKind::Fentry => fentry::can_run(layout),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// By its label (`tail --stats`).
impl serde::Serialize for BackendKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.label())
    }
}

impl std::str::FromStr for BackendKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.label() == s)
            .ok_or_else(|| format!("no capture backend `{s}` (links or fentry)"))
    }
}

/// A backend that cannot capture here, and why, in words the user can act on.
#[derive(Clone, Debug, thiserror::Error)]
#[error("capture backend `{}` ({backend}) cannot run here: {why}", backend.label())]
pub struct Unsupported {
    pub backend: BackendKind,
    pub why: String,
}

/// What a backend is built on: the probes' shared maps (the TC object's, by name), the
/// kernel's field offsets (the `CONFIG` values, by slot) and the id of `bpf_rdonly_cast`
/// where the probes use it (see `observer_common::kfunc`).
pub struct Shared<'a> {
    pub maps: &'a HashMap<String, RawFd>,
    pub fields: &'a [u64],
    pub rdonly_cast: Option<u32>,
}

/// One way of putting probe programs at the plan's points. Small on purpose: the plan,
/// its generation and the probes' configuration stay with [`crate::kernel::probes::Probes`],
/// which calls this per hook. A trait object rather than an enum: each backend keeps state
/// of its own (links by point; trampolines by function and a map from (family, hook,
/// priority, entry or exit) to program), which an enum would have to hold side by side and
/// match on in every method.
pub trait Backend: Send {
    fn kind(&self) -> BackendKind;

    /// Puts the probes at every point of one hook's `plan`; returns the plan as attached
    /// (a point may move to a free priority between the same two tables).
    fn attach(&mut self, plan: HookPlan) -> anyhow::Result<HookPlan>;

    /// Releases the probes of one hook (before it is attached again, re-planned).
    fn detach(&mut self, family: NfFamily, hook: NfHook);

    /// Takes every attachment out: dropping what is returned releases them (callers drop
    /// it where waiting is fine: each release may wait for an RCU grace period).
    fn take_all(&mut self) -> Box<dyn Send>;

    /// How many attachments it holds (links, or trampolines and points).
    fn attachments(&self) -> usize;

    /// Loads (verifies) the programs `plans` need, attaching nothing: what their first
    /// attach would otherwise wait for. Returns how many programs are loaded for them.
    fn preload(&mut self, _plans: &[HookPlan]) -> anyhow::Result<usize> {
        Ok(0)
    }

    /// What it cannot see that the plan asks for (nothing, for links).
    fn blind_spots(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The backend the user asked for (`--backend` of `tail` and `agent`), for every later
/// [`choose`] of this process; `None`: the first that can run.
static REQUESTED: std::sync::Mutex<Option<BackendKind>> = std::sync::Mutex::new(None);

/// Sets the backend the user asked for (see [`choose`]).
pub fn request(kind: Option<BackendKind>) {
    *REQUESTED.lock().unwrap_or_else(|e| e.into_inner()) = kind;
}

/// The backend the user asked for, if any.
pub fn requested() -> Option<BackendKind> {
    *REQUESTED.lock().unwrap_or_else(|e| e.into_inner())
}

/// The backend chosen for the probes, or why none can capture here. Kept rather than
/// raised at load: the agent's default mode loads the probes without any per-table point
/// and runs all the same; attaching points then says why it cannot.
pub enum Chosen {
    Ready(Box<dyn Backend>),
    Refused(Unsupported),
}

impl Chosen {
    /// The backend, or why there is none.
    pub fn backend(&mut self) -> Result<&mut dyn Backend, Unsupported> {
        match self {
            Chosen::Ready(b) => Ok(b.as_mut()),
            Chosen::Refused(why) => Err(why.clone()),
        }
    }

    /// The backend chosen, or the one refused.
    pub fn kind(&self) -> BackendKind {
        match self {
            Chosen::Ready(b) => b.kind(),
            Chosen::Refused(why) => why.backend,
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(self, Chosen::Ready(_))
    }

    /// Why no backend can attach here, when none can.
    pub fn refused(&self) -> Option<&Unsupported> {
        match self {
            Chosen::Ready(_) => None,
            Chosen::Refused(why) => Some(why),
        }
    }

    /// Attachments held now (none without a backend).
    pub fn attachments(&self) -> usize {
        match self {
            Chosen::Ready(b) => b.attachments(),
            Chosen::Refused(_) => 0,
        }
    }
}

/// Picks the capture backend, the one place that does: `requested` (the user's
/// `--backend`; `None`: the one [`request`]ed for this process, if any), else the first
/// that can run here: netfilter links, else fentry trampolines. An error is one of this
/// observer's own (its probe object does not fit its maps); a backend the kernel cannot
/// run is [`Chosen::Refused`] (with neither, links' refusal, which says what to upgrade,
/// with fentry's after it).
pub fn choose(
    requested: Option<BackendKind>,
    layout: &KernelLayout,
    shared: &Shared,
) -> anyhow::Result<Chosen> {
    let kind = match requested.or_else(self::requested) {
        Some(kind) => {
            if let Err(why) = kind.can_run(layout) {
                return Ok(Chosen::Refused(why));
            }
            kind
        }
        None => match BackendKind::Links.can_run(layout) {
            Ok(()) => BackendKind::Links,
            Err(links) => match BackendKind::Fentry.can_run(layout) {
                Ok(()) => {
                    log::info!("capturing through fentry trampolines: {}", links.why);
                    BackendKind::Fentry
                }
                Err(fentry) => {
                    return Ok(Chosen::Refused(Unsupported {
                        backend: BackendKind::Links,
                        why: format!("{}; nor can fentry trampolines: {}", links.why, fentry.why),
                    }));
                }
            },
        },
    };
    Ok(match kind {
        BackendKind::Links => Chosen::Ready(Box::new(links::Links::new(shared)?)),
        BackendKind::Fentry => Chosen::Ready(Box::new(fentry::Fentry::new(shared)?)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_are_named_and_parsed_alike() {
        for k in BackendKind::ALL {
            assert_eq!(k.label().parse::<BackendKind>(), Ok(k));
        }
        assert!("kprobe".parse::<BackendKind>().is_err());
        assert_eq!(BackendKind::Links.to_string(), "netfilter links");
    }

    /// Asking for fentry where the kernel refuses trampolines (this host's, EPERM) says
    /// why, and nothing pretends to capture; where it runs them, fentry is chosen. Skipped,
    /// loudly, without root.
    #[test]
    fn fentry_runs_or_says_why() {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("!!! SKIPPED: not root");
            return;
        }
        let layout = KernelLayout::from_kernel().expect("kernel BTF");
        match BackendKind::Fentry.can_run(&layout) {
            Ok(()) => eprintln!("fentry trampolines run here"),
            Err(e) => {
                assert_eq!(e.backend, BackendKind::Fentry);
                assert!(e.to_string().starts_with("capture backend `fentry`"), "{e}");
                let maps = HashMap::new();
                let shared = Shared {
                    maps: &maps,
                    fields: &layout.config,
                    rdonly_cast: None,
                };
                let mut chosen =
                    choose(Some(BackendKind::Fentry), &layout, &shared).expect("no error");
                assert!(!chosen.is_ready());
                assert_eq!(chosen.attachments(), 0);
                assert_eq!(
                    chosen.backend().err().expect("refused").backend,
                    BackendKind::Fentry
                );
            }
        }
    }
}
