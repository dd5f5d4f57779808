//! The netfilter-link backend: the netfilter object's slot programs (`observer-ebpf`'s
//! `bin/nf.rs`, loaded by [`crate::kernel::nf_link`] onto the TC object's maps), one BPF
//! netfilter link per point of the plan at the point's own priority, moved off priorities
//! that are taken. A program learns nothing of where it is: each point gets the slot
//! program the plan names, so its number is the point. Sees everything the plan asks for.

use anyhow::Result;
use log::{debug, info};

use super::{Backend, BackendKind, Shared, Unsupported};
use crate::kernel::btf::KernelLayout;
use crate::kernel::nf_link::{NfError, NfFamily, NfHook, NfLink, NfObject, load_trivial_program};
use crate::kernel::plan::HookPlan;

/// The netfilter probe object (empty when built with `OBSERVER_SKIP_EBPF=1`).
pub static NF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-nf"));

pub struct Links {
    nf: NfObject,
    links: Vec<NfLink>,
}

/// Netfilter programs load on this kernel, or why not: a trivial one is loaded and
/// released (the program type, not the kernel's version, is what counts: a distribution
/// may backport it, or build without `CONFIG_NETFILTER_BPF_LINK`).
pub fn can_run(_layout: &KernelLayout) -> Result<(), Unsupported> {
    load_trivial_program().map_err(|e| refusal(&e, &kernel_release()))
}

/// Why netfilter links cannot run, from the error of the trivial program's load on kernel
/// `release`.
fn refusal(e: &std::io::Error, release: &str) -> Unsupported {
    let why = match e.raw_os_error() {
        Some(libc::EINVAL) => format!(
            "BPF netfilter links need Linux 6.4+ with CONFIG_NETFILTER_BPF_LINK=y; this kernel \
             ({release}) refuses netfilter programs (EINVAL)"
        ),
        Some(libc::EPERM) => format!(
            "loading a BPF program was refused ({e}): run as root, or with CAP_BPF and \
             CAP_NET_ADMIN"
        ),
        _ => format!("a trivial netfilter program did not load on this kernel ({release}): {e}"),
    };
    Unsupported {
        backend: BackendKind::Links,
        why,
    }
}

/// `uname -r`, for messages.
fn kernel_release() -> String {
    // SAFETY: utsname is plain data; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a valid utsname to fill.
    if unsafe { libc::uname(&mut u) } != 0 {
        return "release unknown".into();
    }
    // SAFETY: uname NUL-terminates the field.
    let release = unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) };
    format!("Linux {}", release.to_string_lossy())
}

impl Links {
    /// Parses the netfilter object onto the shared maps (nothing is loaded yet: each slot
    /// program is loaded the first time a point needs it). The netfilter programs log
    /// nothing (`observer_ebpf::inflight::Diag`): nf_link loads no aya-log map or global.
    pub fn new(shared: &Shared) -> Result<Self, NfError> {
        Ok(Self {
            nf: NfObject::parse(NF_OBJECT, shared.maps, shared.fields, shared.rdonly_cast)?,
            links: Vec::new(),
        })
    }
}

impl Backend for Links {
    fn kind(&self) -> BackendKind {
        BackendKind::Links
    }

    /// A point whose priority is taken (EBUSY) moves to the nearest free priority between
    /// the same two tables.
    fn attach(&mut self, mut plan: HookPlan) -> Result<HookPlan> {
        debug!("{plan}; probes at {:?}", plan.points);
        for slot in 0..plan.points.len() {
            let prog = self
                .nf
                .program_mut(&format!("nf_slot_{}", plan.programs[slot]))?;
            prog.load()?;
            let mut candidates = vec![plan.points[slot]];
            candidates.extend(plan.fallbacks(slot));
            let mut last_err = None;
            for prio in candidates {
                match prog.attach(plan.family, plan.hook, prio) {
                    Ok(link) => {
                        if prio != plan.points[slot] {
                            // ipv6 conntrack confirms at INPUT INT_MAX-1, for one.
                            info!(
                                "{}/{} priority {} is taken; probing at {prio} instead",
                                plan.family.name(),
                                plan.hook.name(),
                                plan.points[slot]
                            );
                            plan.points[slot] = prio;
                        }
                        self.links.push(link);
                        last_err = None;
                        break;
                    }
                    Err(e @ NfError::Attach { .. }) if is_busy(&e) => last_err = Some(e),
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(e) = last_err {
                return Err(e.into());
            }
        }
        Ok(plan)
    }

    fn detach(&mut self, family: NfFamily, hook: NfHook) {
        self.links
            .retain(|l| !(l.family == family && l.hook == hook));
    }

    fn take_all(&mut self) -> Box<dyn Send> {
        Box::new(std::mem::take(&mut self.links))
    }

    /// The slot programs of `plans`, loaded once and kept (attach loads those not loaded).
    fn preload(&mut self, plans: &[HookPlan]) -> Result<usize> {
        let programs: std::collections::BTreeSet<_> = plans
            .iter()
            .flat_map(|p| p.programs.iter().copied())
            .collect();
        for p in &programs {
            self.nf.program_mut(&format!("nf_slot_{p}"))?.load()?;
        }
        Ok(programs.len())
    }

    fn attachments(&self) -> usize {
        self.links.len()
    }
}

fn is_busy(e: &NfError) -> bool {
    matches!(e, NfError::Attach { error, .. } if error.raw_os_error() == Some(libc::EBUSY))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the user is told when the kernel refuses, as the kernel refuses.
    #[test]
    fn a_refusal_says_why_and_what_to_do() {
        let einval = std::io::Error::from_raw_os_error(libc::EINVAL);
        let e = refusal(&einval, "Linux 6.1.0-37-amd64").to_string();
        assert_eq!(
            e,
            "capture backend `links` (netfilter links) cannot run here: BPF netfilter links \
             need Linux 6.4+ with CONFIG_NETFILTER_BPF_LINK=y; this kernel (Linux \
             6.1.0-37-amd64) refuses netfilter programs (EINVAL)"
        );
        let eperm = std::io::Error::from_raw_os_error(libc::EPERM);
        assert!(refusal(&eperm, "x").to_string().contains("run as root"));
    }

    /// The trial load agrees with the kernel's BTF: netfilter programs load where the
    /// kernel has their context (`struct bpf_nf_ctx`, 6.4+), and the refusal says why.
    /// Skipped, loudly, without root.
    #[test]
    fn the_trial_load_agrees_with_the_kernels_btf() {
        use crate::kernel::btf_raw::{KIND_STRUCT, RawBtf};
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("!!! SKIPPED: not root");
            return;
        }
        let raw = std::fs::read("/sys/kernel/btf/vmlinux").expect("kernel BTF");
        let btf = RawBtf::parse(raw).expect("parses");
        let has_ctx = btf.id_of("bpf_nf_ctx", &[KIND_STRUCT]).is_some();
        let layout = KernelLayout::from_kernel().expect("kernel BTF");
        match can_run(&layout) {
            Ok(()) => assert!(has_ctx, "netfilter programs load without bpf_nf_ctx?"),
            Err(e) => {
                eprintln!("refused, as it should be: {e}");
                assert!(!has_ctx, "{e}");
                assert!(e.to_string().contains("Linux 6.4+"), "{e}");
            }
        }
    }
}
