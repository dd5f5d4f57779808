//! Tier 0's IPVS series: IPVS's own statistics per virtual service and real server, read on
//! tier 0's thread through `observer_nfstats::ipvs` (generic netlink, no probe), named with
//! the Kubernetes service where the agent's names hold the virtual service's address and
//! port (kube-proxy's rules, see `crate::k8s`) or kube-proxy's ipsets carry a comment for it.
//!
//! A kernel without IPVS is no error: said once at info level, and looked for again at each
//! read (kube-proxy may load `ip_vs` after the agent starts).

use std::sync::Arc;

use log::{info, warn};
use observer_nfstats::ipvs::{self, VirtualKey};
use observer_nfstats::ipvs_series::IpvsSeries;
use observer_nfstats::{Sample, Service, series};

use crate::k8s::Names;
use crate::k8s::services::ServiceNames;

pub struct Ipvs {
    reader: Option<ipvs::Reader>,
    series: IpvsSeries,
    names: Option<Arc<Names>>,
    /// Names from kube-proxy's ipsets' comments, read again when the virtual services change.
    from_ipsets: ServiceNames,
    keys: Vec<VirtualKey>,
    said_absent: bool,
    /// Whether a read has found IPVS: only then are there series.
    found: bool,
}

impl Ipvs {
    pub fn new(cap: usize, names: Option<Arc<Names>>) -> Self {
        Self {
            reader: None,
            series: IpvsSeries::new(cap),
            names,
            from_ipsets: ServiceNames::default(),
            keys: Vec::new(),
            said_absent: false,
            found: false,
        }
    }

    /// One read (in the observed namespace, on tier 0's thread). Err: a read that failed
    /// (logged by the caller, counted in tier 0's errors).
    pub fn read(&mut self) -> Result<(), observer_nfstats::Error> {
        if self.reader.is_none() {
            match ipvs::Reader::open()? {
                Some(r) => {
                    info!("IPVS found: tier 0 counts its virtual services and real servers");
                    self.reader = Some(r);
                }
                None => {
                    if !self.said_absent {
                        info!("{}: no IPVS series", ipvs::ABSENT);
                        self.said_absent = true;
                    }
                    return Ok(());
                }
            }
        }
        let Some(reader) = self.reader.as_mut() else {
            return Ok(());
        };
        let services = match reader.read() {
            Ok(s) => s,
            Err(e) => {
                // The module may have gone (rmmod ip_vs): the family is looked for again.
                self.reader = None;
                return Err(e);
            }
        };
        self.found = true;
        let keys: Vec<VirtualKey> = services.iter().map(|s| s.key).collect();
        if keys != self.keys {
            self.from_ipsets = read_ipset_names();
            self.keys = keys;
        }
        let (from_ipsets, names) = (&self.from_ipsets, self.names.as_deref());
        self.series
            .update(services, &|k| name_of(k, from_ipsets, names));
        Ok(())
    }

    /// The series, none where IPVS was never found.
    pub fn samples(&self, extra: &series::Labels) -> Vec<Sample> {
        if self.found {
            self.series.samples(extra)
        } else {
            Vec::new()
        }
    }
}

/// `ipset save`'s names (nothing where ipset is absent or fails: the services then go by
/// their addresses).
fn read_ipset_names() -> ServiceNames {
    match std::process::Command::new("ipset").arg("save").output() {
        Ok(o) if o.status.success() => {
            ServiceNames::from_ipset_save(&String::from_utf8_lossy(&o.stdout))
        }
        Ok(o) => {
            warn!(
                "`ipset save` failed ({}): IPVS services are named by address only",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            ServiceNames::default()
        }
        Err(_) => ServiceNames::default(),
    }
}

/// The Kubernetes service of a virtual service: kube-proxy's ipset comments first, then
/// the agent's names of the address and port; a node port by its port.
fn name_of(k: &VirtualKey, ipsets: &ServiceNames, names: Option<&Names>) -> Option<Service> {
    let VirtualKey::Addr { proto, addr, port } = *k else {
        return None;
    };
    let agent = names.map(|n| n.services.read().unwrap_or_else(|e| e.into_inner()));
    let text = ipsets
        .lookup(addr, proto, port)
        .map(str::to_string)
        .or_else(|| {
            agent
                .as_ref()
                .and_then(|a| a.lookup(addr, proto, port).map(str::to_string))
        })
        .or_else(|| ipsets.node_port(proto, port).map(str::to_string))?;
    let (namespace, rest) = text.split_once('/')?;
    let (name, port) = rest.split_once(':').unwrap_or((rest, ""));
    Some(Service {
        namespace: namespace.into(),
        name: name.into(),
        port: port.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_ipsets_then_the_agent_then_node_ports() {
        let sets = ServiceNames::from_ipset_save(
            "add KUBE-CLUSTER-IP 10.10.10.2,tcp:22 comment \"default/registry:ssh\"\n\
             add KUBE-NODE-PORT-TCP 30022 comment \"default/registry:ssh\"\n",
        );
        let key = |a: &str, port| VirtualKey::Addr {
            proto: 6,
            addr: a.parse().unwrap(),
            port,
        };
        let s = name_of(&key("10.10.10.2", 22), &sets, None).unwrap();
        assert_eq!(
            (s.namespace.as_str(), s.name.as_str(), s.port.as_str()),
            ("default", "registry", "ssh")
        );
        let np = name_of(&key("198.51.100.1", 30022), &sets, None).unwrap();
        assert_eq!(np.name, "registry");
        assert_eq!(name_of(&key("10.10.10.3", 80), &sets, None), None);
        assert_eq!(
            name_of(&VirtualKey::Fwmark { v6: false, mark: 1 }, &sets, None),
            None
        );
    }
}
