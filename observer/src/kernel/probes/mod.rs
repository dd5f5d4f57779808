//! Kernel side: loads the probe objects, hands them the BTF offsets, and attaches them.
//! Aya loads the TC object (which owns the maps); the capture backend
//! ([`crate::kernel::capture`]: today netfilter links, [`crate::kernel::nf_link`] loading the
//! netfilter object onto those same maps) puts the per-table probes at the plan's points.
//! Everything attaches in the calling thread's network namespace and detaches when
//! [`Probes`] is dropped (or the process dies: links are fd-owned).
//!
//! By concern: [`load`] (objects, configuration, counting/tracing), [`tc`], [`points`] (the
//! plan's points through the capture backend, re-plans), [`ends`] (tracepoints, socket
//! probe), [`maps`] (counters, in-flight, sweep, ring buffers), [`release`].

mod ends;
mod load;
mod maps;
mod points;
mod release;
mod tc;

use std::collections::{HashMap, HashSet};

use aya::Ebpf;

use crate::kernel::btf::KernelLayout;
use crate::kernel::capture::links::NF_OBJECT;
use crate::kernel::capture::{self, Chosen};
use crate::kernel::netns::current_netns_inode;
use crate::kernel::netns::interfaces;
use crate::kernel::nf_link::{NfFamily, NfHook, patch_object_calls};
use crate::kernel::plan::HookPlan;

pub use maps::{InFlight, KernelCounters};
use tc::Attached;
pub use tc::InterfaceChanges;

static TC_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/observer-tc"));

pub struct Probes {
    ebpf: Ebpf,
    /// What puts the per-table probes at the plan's points (or why nothing can here).
    capture: Chosen,
    /// The probes' diagnostics (aya-log), when the user's log level shows them.
    log: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    tc: HashMap<u32, Attached>,
    /// Interfaces where attaching failed, so the failure is reported once per interface.
    tc_failed: HashSet<u32>,
    /// Removes the netlink TC filters (no tcx before 6.6) if observer dies without doing so.
    tc_guard: crate::kernel::tc_guard::TcGuard,
    /// Attach failures since start (tcx and per-table probes), for the summary.
    pub attach_failures: u64,
    /// The plan as attached (priorities may have moved off EBUSY ones).
    pub plans: Vec<HookPlan>,
    generation: u8,
    /// Records the collector took out of the fallback map (`pending_count::COLLECTED`).
    collected: u64,
    /// Whether traversals are recorded (else the probes only count: [`Probes::load_counting`]):
    /// the tcx, consume_skb and socket probes are attached only then.
    tracing: bool,
    /// Why the kernel refused the TC programs (loaded for counting only): no tracing then.
    tc_refused: Option<String>,
    /// The consume_skb tracepoint's link while tracing (its program stays loaded).
    consume_link: Option<aya::programs::tp_btf::BtfTracePointLinkId>,
}

#[cfg(test)]
mod tests {
    use super::load::MAPS;
    use super::*;
    use crate::kernel::nf_link::{NfError, NfObject};
    use observer_common::NF_SLOTS;
    use observer_common::config;
    use std::os::fd::RawFd;

    /// The load-time layout diagnostic: silent for this kernel's layout, said (with the
    /// offsets) for one whose conntrack tuples fall outside the probes' window.
    #[test]
    fn an_unexpected_conntrack_layout_is_said_once_at_load() {
        let layout = crate::kernel::btf::KernelLayout::from_kernel().expect("kernel BTF");
        assert_eq!(super::load::unexpected_layout(&layout.config), None);
        let mut moved = layout.config.clone();
        let start = moved[config::CT_WINDOW as usize];
        moved[config::CT_TUPLE_REPLY as usize] = start + 150;
        let said = super::load::unexpected_layout(&moved).expect("said");
        assert!(
            said.contains(&format!("reply at Some({})", start + 150)),
            "{said}"
        );
        moved[config::CT_TUPLE_REPLY as usize] = config::UNSET;
        assert!(super::load::unexpected_layout(&moved).is_some());
    }

    /// True, loudly, when the probes were not built (`OBSERVER_SKIP_EBPF=1`), which CI never
    /// does: the test has nothing to check.
    fn built_without(object: &[u8]) -> bool {
        if !object.is_empty() {
            return false;
        }
        eprintln!("!!! SKIPPED: built with OBSERVER_SKIP_EBPF=1");
        assert!(!observer_tests_in_ci(), "CI builds the probes");
        true
    }

    /// The embedded netfilter object must hold every slot program, each relocatable with map
    /// references only (no BPF-to-BPF calls, no global data), which is all nf_link supports.
    /// (The probes' aya-log diagnostics are the TC object's alone: see
    /// `observer_ebpf::inflight::Diag`.)
    #[test]
    fn embedded_netfilter_object_is_loadable_by_nf_link() {
        if built_without(NF_OBJECT) {
            return;
        }
        let fds: HashMap<String, RawFd> = MAPS.iter().map(|m| (m.to_string(), 1000)).collect();
        let layout = crate::kernel::btf::KernelLayout::from_kernel().expect("kernel BTF");
        let mut obj = NfObject::parse(NF_OBJECT, &fds, &layout.config, layout.rdonly_cast)
            .expect("netfilter object parses");
        for slot in 0..NF_SLOTS {
            obj.program_mut(&format!("nf_slot_{slot}"))
                .expect("slot program present");
        }
        assert!(obj.program_mut(&format!("nf_slot_{NF_SLOTS}")).is_err());
        // Without the shared maps the object cannot be relocated.
        assert!(matches!(
            NfObject::parse(NF_OBJECT, &HashMap::new(), &layout.config, None),
            Err(NfError::UnsupportedRelocation { .. })
        ));
    }

    /// The embedded trampoline object holds an fentry and an fexit program for every
    /// function the fentry backend sits on, relocatable onto the shared maps and the
    /// backend's own `FENTRY_POINTS`.
    #[test]
    fn embedded_trampoline_object_is_loadable_by_nf_link() {
        use crate::kernel::capture::fentry::FENTRY_OBJECT;
        if built_without(FENTRY_OBJECT) {
            return;
        }
        let mut fds: HashMap<String, RawFd> = MAPS.iter().map(|m| (m.to_string(), 1000)).collect();
        fds.insert("FENTRY_POINTS".into(), 1001);
        let layout = crate::kernel::btf::KernelLayout::from_kernel().expect("kernel BTF");
        let mut obj = NfObject::parse(FENTRY_OBJECT, &fds, &layout.config, layout.rdonly_cast)
            .expect("trampoline object parses");
        for f in crate::kernel::capture::fentry::functions() {
            for side in ["fentry", "fexit"] {
                obj.program_mut(&format!("{side}/{f}"))
                    .expect("trampoline program present");
            }
        }
        fds.remove("FENTRY_POINTS");
        assert!(matches!(
            NfObject::parse(FENTRY_OBJECT, &fds, &layout.config, None),
            Err(NfError::UnsupportedRelocation { .. })
        ));
    }

    /// The TC object's code calls the placeholders (`observer_common::kfunc`); patched, none
    /// is left, whether the kernel takes direct reads or not, and nothing else changed size.
    #[test]
    fn the_tc_objects_placeholder_calls_are_all_rewritten() {
        if built_without(TC_OBJECT) {
            return;
        }
        let placeholders = |bytes: &[u8]| {
            bytes
                .chunks_exact(8)
                .filter(|i| {
                    i[0] == 0x85
                        && [
                            observer_common::kfunc::DIRECT_READS,
                            observer_common::kfunc::UNTRUSTED,
                        ]
                        .contains(&i32::from_le_bytes([i[4], i[5], i[6], i[7]]))
                })
                .count()
        };
        assert!(
            placeholders(TC_OBJECT) > 0,
            "the TC probes read through them"
        );
        let layout = crate::kernel::btf::KernelLayout::from_kernel().expect("kernel BTF");
        for cast in [Some(4242), None] {
            let patched = patch_object_calls(TC_OBJECT, cast, &layout.config).expect("patched");
            let bytes = patched.bytes();
            assert_eq!(placeholders(bytes), 0, "{cast:?}");
            assert!(object::File::parse(bytes).is_ok());
        }
        // The drop tracepoint loads fields directly: without their offsets it cannot be
        // patched, and the error names the instruction.
        let mut no_dev = layout.config.clone();
        no_dev[observer_common::config::NETDEV_NET as usize] = observer_common::config::UNSET;
        assert!(matches!(
            patch_object_calls(TC_OBJECT, None, &no_dev),
            Err(NfError::Placeholder { .. })
        ));
    }

    fn observer_tests_in_ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
            || std::env::var("OBSERVER_NO_SKIP").is_ok_and(|v| v == "1")
    }
}
