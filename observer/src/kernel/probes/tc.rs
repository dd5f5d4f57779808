//! tcx: TC ingress and egress on every interface of the namespace, kept in line with
//! interfaces as they come, go and are renamed.

use std::collections::HashMap;

use anyhow::Result;
use aya::programs::tc::{SchedClassifierLink, TcError};
use aya::programs::{ProgramError, SchedClassifier, TcAttachType};

use super::*;
use crate::kernel::tc_guard::NetlinkFilter;

pub(super) const TC_PROGRAMS: [(&str, TcAttachType); 2] = [
    ("observer_tc_ingress", TcAttachType::Ingress),
    ("observer_tc_egress", TcAttachType::Egress),
];

/// The TC programs of a bridge device, attached there instead of [`TC_PROGRAMS`]: a frame
/// passed up from a port goes on, and nothing ends at the bridge's own transmit (it hands
/// the skb on to a port).
pub(super) const TC_BRIDGE_PROGRAMS: [(&str, TcAttachType); 2] = [
    ("observer_tc_bridge_ingress", TcAttachType::Ingress),
    ("observer_tc_bridge_egress", TcAttachType::Egress),
];

/// An interface with TC probes: tcx links (6.6+) or netlink filters, which the guard
/// process also knows of (`kernel::tc_guard`).
pub(super) struct Attached {
    pub(super) name: String,
    pub(super) links: Vec<(u32, SchedClassifierLink)>,
}

/// What changed among the namespace's interfaces since the last scan.
#[derive(Debug, Default)]
pub struct InterfaceChanges {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// (old name, new name).
    pub renamed: Vec<(String, String)>,
    /// (interface, error): the probes could not attach there.
    pub failed: Vec<(String, String)>,
}

impl Probes {
    /// Brings the tcx probes in line with the namespace's interfaces: attaches to new ones,
    /// releases the links of those that are gone, and notes renames. An interface where
    /// attaching fails is reported (once) and counted, never skipped silently.
    pub fn sync_interfaces(&mut self) -> Result<InterfaceChanges> {
        if !self.tracing {
            // Counting only: no tcx (see `start_tracing`).
            return Ok(InterfaceChanges::default());
        }
        let now: HashMap<u32, String> = interfaces().into_iter().collect();
        let mut changes = InterfaceChanges::default();
        let gone: Vec<u32> = self
            .tc
            .keys()
            .filter(|i| !now.contains_key(i))
            .copied()
            .collect();
        for index in gone {
            let a = self.tc.remove(&index).expect("listed");
            // The kernel detached them with the device; this releases our links and fds.
            self.release_tc(a.links);
            changes.removed.push(a.name);
        }
        self.tc_failed.retain(|i| now.contains_key(i));
        for (&index, name) in &now {
            if let Some(a) = self.tc.get_mut(&index) {
                if &a.name != name {
                    changes
                        .renamed
                        .push((std::mem::replace(&mut a.name, name.clone()), name.clone()));
                }
                continue;
            }
            if self.tc_failed.contains(&index) {
                continue;
            }
            let mut links = Vec::new();
            let mut failed = None;
            let programs = if crate::kernel::netns::is_bridge(name) {
                TC_BRIDGE_PROGRAMS
            } else {
                TC_PROGRAMS
            };
            for (prog, at) in programs {
                let p: &mut SchedClassifier = self
                    .ebpf
                    .program_mut(prog)
                    .expect("loaded in Probes::load")
                    .try_into()?;
                // Before 6.6 (no tcx) Aya attaches through netlink, which needs the clsact
                // qdisc: added where it is missing (and left there, as `tc` leaves it).
                let attached = p.attach(name, at).or_else(|e| match &e {
                    ProgramError::TcError(TcError::NetlinkError(_)) => {
                        let _ = aya::programs::tc::qdisc_add_clsact(name);
                        p.attach(name, at)
                    }
                    _ => Err(e),
                });
                match attached.and_then(|id| p.take_link(id)) {
                    Ok(link) => {
                        if let Some(f) = NetlinkFilter::of(index, &link) {
                            self.tc_guard.watch(&f);
                        }
                        links.push((index, link));
                    }
                    Err(e) => {
                        failed = Some(format!("tc {at:?}: {e}"));
                        break;
                    }
                }
            }
            if let Some(e) = failed {
                // Undo a half attachment: an interface is either fully probed or reported.
                self.release_tc(links);
                // One that vanished between listing and attaching is no failure.
                if interfaces().iter().any(|(i, _)| *i == index) {
                    self.attach_failures += 1;
                    self.tc_failed.insert(index);
                    changes.failed.push((name.clone(), e));
                }
                continue;
            }
            self.tc.insert(
                index,
                Attached {
                    name: name.clone(),
                    links,
                },
            );
            changes.added.push(name.clone());
        }
        changes.added.sort();
        Ok(changes)
    }

    /// The TC links, for whoever drops them to detach them (the guard forgets the netlink
    /// filters among them first).
    pub(super) fn take_tc_links(&mut self) -> Vec<SchedClassifierLink> {
        let mut taken = Vec::new();
        for (_, a) in self.tc.drain() {
            for (index, link) in a.links {
                if let Some(f) = NetlinkFilter::of(index, &link) {
                    self.tc_guard.forget(&f);
                }
                taken.push(link);
            }
        }
        taken
    }

    /// Detaches `links` now.
    fn release_tc(&mut self, links: Vec<(u32, SchedClassifierLink)>) {
        for (index, link) in links {
            if let Some(f) = NetlinkFilter::of(index, &link) {
                self.tc_guard.forget(&f);
            }
            drop(link);
        }
    }
}
