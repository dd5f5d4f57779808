//! IPVS's statistics ([`crate::ipvs`]) into metric series: per virtual service and per real
//! server, connections, packets and bytes as counters that add each read's increase (a
//! service or real server made again starts from zero and is counted from there, never
//! backwards), and what is true now (real servers, connection entries, weights) as gauges.
//!
//! A virtual service is labelled with its protocol and address:port, and with the
//! Kubernetes service the caller's names give for it (empty labels otherwise); a real
//! server with its address:port as `endpoint`. Bounded by a cap on the series.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::ipvs::{Stats, VirtualKey, VirtualService};
use crate::rules::Service;
use crate::series::{Family, Labels, Sample};

/// Counter series a virtual service makes (connections, packets and bytes both ways, and
/// its real servers' gauge).
const PER_SERVICE: usize = 6;
/// A real server's: connections, packets and bytes both ways, two entry gauges, its weight.
const PER_SERVER: usize = 8;

type ServerKey = (VirtualKey, IpAddr, u16);

/// The counters added up since the agent started (each read adds what grew).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Totals {
    last: Stats,
    sum: Stats,
}

impl Totals {
    fn add(&mut self, now: Stats) {
        // Lower than last time: made again, its counters start at zero.
        let d = |now: u64, last: u64| if now >= last { now - last } else { now };
        self.sum.conns += d(now.conns, self.last.conns);
        self.sum.in_packets += d(now.in_packets, self.last.in_packets);
        self.sum.out_packets += d(now.out_packets, self.last.out_packets);
        self.sum.in_bytes += d(now.in_bytes, self.last.in_bytes);
        self.sum.out_bytes += d(now.out_bytes, self.last.out_bytes);
        self.last = now;
    }
}

/// IPVS's statistics kept as series across reads.
pub struct IpvsSeries {
    cap: usize,
    services: BTreeMap<VirtualKey, Totals>,
    servers: BTreeMap<ServerKey, Totals>,
    /// The last read, for the gauges and the labels (names can come after the counts).
    now: Vec<VirtualService>,
    names: BTreeMap<VirtualKey, Service>,
    left_out: u64,
}

impl IpvsSeries {
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            services: BTreeMap::new(),
            servers: BTreeMap::new(),
            now: Vec::new(),
            names: BTreeMap::new(),
            left_out: 0,
        }
    }

    fn series(&self) -> usize {
        self.services.len() * PER_SERVICE + self.servers.len() * PER_SERVER
    }

    /// Takes one read of IPVS's table; `name` gives the Kubernetes service of a virtual
    /// service, where known.
    pub fn update(
        &mut self,
        services: Vec<VirtualService>,
        name: &dyn Fn(&VirtualKey) -> Option<Service>,
    ) {
        self.left_out = 0;
        self.names.clear();
        let mut kept = Vec::with_capacity(services.len());
        for mut s in services {
            if !self.services.contains_key(&s.key) {
                if self.series() + PER_SERVICE > self.cap {
                    self.left_out += 1 + s.real_servers.len() as u64;
                    continue;
                }
                self.services.insert(s.key, Totals::default());
            }
            if let Some(t) = self.services.get_mut(&s.key) {
                t.add(s.stats);
            }
            if let Some(n) = name(&s.key) {
                self.names.insert(s.key, n);
            }
            let key = s.key;
            s.real_servers.retain(|r| {
                let k = (key, r.addr, r.port);
                if !self.servers.contains_key(&k) {
                    if self.services.len() * PER_SERVICE + (self.servers.len() + 1) * PER_SERVER
                        > self.cap
                    {
                        self.left_out += 1;
                        return false;
                    }
                    self.servers.insert(k, Totals::default());
                }
                if let Some(t) = self.servers.get_mut(&k) {
                    t.add(r.stats);
                }
                true
            });
            kept.push(s);
        }
        self.now = kept;
    }

    fn service_labels(&self, key: &VirtualKey) -> Labels {
        let n = self.names.get(key);
        vec![
            ("protocol", key.protocol()),
            ("virtual_service", key.address()),
            (
                "namespace",
                n.map(|n| n.namespace.clone()).unwrap_or_default(),
            ),
            ("service", n.map(|n| n.name.clone()).unwrap_or_default()),
            ("port", n.map(|n| n.port.clone()).unwrap_or_default()),
        ]
    }

    /// Every series, `extra` labels (node, tier) first on each. Counters stay after their
    /// service or real server is gone (series are never taken back); gauges are the last
    /// read's.
    pub fn samples(&self, extra: &Labels) -> Vec<Sample> {
        let mut out = Vec::new();
        let mut push = |family, labels: Labels, value| {
            out.push(Sample {
                family,
                labels: extra.iter().cloned().chain(labels).collect(),
                value,
            });
        };
        let with = |mut l: Labels, more: &[(&'static str, String)]| {
            l.extend(more.iter().cloned());
            l
        };
        let dir = |d: &str| [("direction", d.to_string())];
        for (key, t) in &self.services {
            let l = self.service_labels(key);
            push(Family::IpvsConnections, l.clone(), t.sum.conns);
            push(
                Family::IpvsPackets,
                with(l.clone(), &dir("in")),
                t.sum.in_packets,
            );
            push(
                Family::IpvsPackets,
                with(l.clone(), &dir("out")),
                t.sum.out_packets,
            );
            push(
                Family::IpvsBytes,
                with(l.clone(), &dir("in")),
                t.sum.in_bytes,
            );
            push(Family::IpvsBytes, with(l, &dir("out")), t.sum.out_bytes);
        }
        for ((key, addr, port), t) in &self.servers {
            let l = with(
                self.service_labels(key),
                &[("endpoint", crate::ipvs::endpoint(*addr, *port))],
            );
            push(Family::IpvsServerConnections, l.clone(), t.sum.conns);
            push(
                Family::IpvsServerPackets,
                with(l.clone(), &dir("in")),
                t.sum.in_packets,
            );
            push(
                Family::IpvsServerPackets,
                with(l.clone(), &dir("out")),
                t.sum.out_packets,
            );
            push(
                Family::IpvsServerBytes,
                with(l.clone(), &dir("in")),
                t.sum.in_bytes,
            );
            push(
                Family::IpvsServerBytes,
                with(l, &dir("out")),
                t.sum.out_bytes,
            );
        }
        for s in &self.now {
            push(
                Family::IpvsRealServers,
                with(
                    self.service_labels(&s.key),
                    &[("scheduler", s.scheduler.clone())],
                ),
                s.real_servers.len() as u64,
            );
            for r in &s.real_servers {
                let l = with(self.service_labels(&s.key), &[("endpoint", r.endpoint())]);
                for (state, n) in [("active", r.active), ("inactive", r.inactive)] {
                    push(
                        Family::IpvsServerEntries,
                        with(l.clone(), &[("state", state.into())]),
                        u64::from(n),
                    );
                }
                push(
                    Family::IpvsServerWeight,
                    with(l, &[("forward", r.forward.name())]),
                    u64::from(r.weight),
                );
            }
        }
        push(Family::IpvsLeftOut, vec![], self.left_out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipvs::{Forward, RealServer};

    fn stats(conns: u64, packets: u64) -> Stats {
        Stats {
            conns,
            in_packets: packets,
            out_packets: packets / 2,
            in_bytes: packets * 60,
            out_bytes: packets * 40,
        }
    }

    fn service(port: u16, conns: u64, servers: &[(&str, u64)]) -> VirtualService {
        VirtualService {
            key: VirtualKey::Addr {
                proto: 6,
                addr: "10.96.0.10".parse().unwrap(),
                port,
            },
            scheduler: "rr".into(),
            pe: None,
            flags: 0,
            timeout: 0,
            stats: stats(conns, conns * 5),
            real_servers: servers
                .iter()
                .map(|(a, c)| RealServer {
                    addr: a.parse().unwrap(),
                    port,
                    forward: Forward::Masq,
                    weight: 1,
                    active: 1,
                    inactive: 2,
                    persistent: 0,
                    stats: stats(*c, c * 5),
                })
                .collect(),
        }
    }

    fn named(k: &VirtualKey) -> Option<Service> {
        matches!(k, VirtualKey::Addr { port: 53, .. }).then(|| Service {
            namespace: "kube-system".into(),
            name: "kube-dns".into(),
            port: "dns-tcp".into(),
        })
    }

    fn value(s: &IpvsSeries, family: Family, want: &[(&str, &str)]) -> Option<u64> {
        s.samples(&vec![])
            .into_iter()
            .find(|x| {
                x.family == family
                    && want
                        .iter()
                        .all(|(k, v)| x.labels.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|x| x.value)
    }

    #[test]
    fn reads_add_up_named_and_never_go_backwards() {
        let mut s = IpvsSeries::new(1000);
        s.update(
            vec![service(53, 4, &[("10.244.1.5", 3), ("10.244.2.5", 1)])],
            &named,
        );
        let svc = [
            ("protocol", "tcp"),
            ("virtual_service", "10.96.0.10:53"),
            ("namespace", "kube-system"),
            ("service", "kube-dns"),
            ("port", "dns-tcp"),
        ];
        assert_eq!(value(&s, Family::IpvsConnections, &svc), Some(4));
        let rs = [("endpoint", "10.244.1.5:53"), ("service", "kube-dns")];
        assert_eq!(value(&s, Family::IpvsServerConnections, &rs), Some(3));
        assert_eq!(
            value(&s, Family::IpvsServerPackets, &[rs[0], ("direction", "in")]),
            Some(15)
        );
        assert_eq!(
            value(&s, Family::IpvsServerBytes, &[rs[0], ("direction", "out")]),
            Some(600)
        );
        s.update(
            vec![service(53, 9, &[("10.244.1.5", 7), ("10.244.2.5", 2)])],
            &named,
        );
        assert_eq!(value(&s, Family::IpvsConnections, &svc), Some(9));
        assert_eq!(value(&s, Family::IpvsServerConnections, &rs), Some(7));
        // Made again (ipvsadm -D, -A): from zero, the series goes on from 7.
        s.update(vec![service(53, 2, &[("10.244.1.5", 2)])], &named);
        assert_eq!(value(&s, Family::IpvsConnections, &svc), Some(11));
        assert_eq!(value(&s, Family::IpvsServerConnections, &rs), Some(9));
        // The gone real server keeps its counter; its gauges are gone.
        let gone = [("endpoint", "10.244.2.5:53")];
        assert_eq!(value(&s, Family::IpvsServerConnections, &gone), Some(2));
        assert_eq!(value(&s, Family::IpvsServerWeight, &gone), None);
        assert_eq!(
            value(&s, Family::IpvsRealServers, &[("scheduler", "rr")]),
            Some(1)
        );
        assert_eq!(
            value(
                &s,
                Family::IpvsServerEntries,
                &[rs[0], ("state", "inactive")]
            ),
            Some(2)
        );
        assert_eq!(
            value(&s, Family::IpvsServerWeight, &[rs[0], ("forward", "Masq")]),
            Some(1)
        );
    }

    #[test]
    fn an_unnamed_service_has_its_address_only() {
        let mut s = IpvsSeries::new(1000);
        s.update(vec![service(80, 1, &[("10.244.1.5", 1)])], &named);
        assert_eq!(
            value(
                &s,
                Family::IpvsConnections,
                &[
                    ("virtual_service", "10.96.0.10:80"),
                    ("namespace", ""),
                    ("service", ""),
                    ("port", "")
                ]
            ),
            Some(1)
        );
    }

    #[test]
    fn the_cap_leaves_services_and_servers_out_and_says_so() {
        // Room for one service and one real server.
        let mut s = IpvsSeries::new(PER_SERVICE + PER_SERVER);
        s.update(
            vec![
                service(53, 4, &[("10.244.1.5", 3), ("10.244.2.5", 1)]),
                service(80, 1, &[("10.244.1.6", 1)]),
            ],
            &named,
        );
        assert_eq!(value(&s, Family::IpvsLeftOut, &[]), Some(3));
        assert_eq!(
            s.samples(&vec![])
                .iter()
                .filter(|x| x.family == Family::IpvsServerConnections)
                .count(),
            1
        );
        assert_eq!(
            value(
                &s,
                Family::IpvsConnections,
                &[("virtual_service", "10.96.0.10:80")]
            ),
            None
        );
    }
}
