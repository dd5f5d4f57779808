//! IPVS's step in the walk (net/netfilter/ipvs/ip_vs_core.c, `ip_vs_ops4`/`ip_vs_ops6`):
//! `ip_vs_in_hook` runs at LOCAL_IN priority 99 (NF_IP_PRI_NAT_SRC - 1: after mangle,
//! filter and security, before nat INPUT) for packets routed to this host, and at LOCAL_OUT
//! -98 (NF_IP_PRI_NAT_DST + 2: after raw, conntrack, mangle and nat OUTPUT) for packets the
//! host sends. A packet reaching a virtual service is scheduled to a real server. In
//! masquerade mode its destination is rewritten; IPVS then sends it itself
//! (`ip_vs_nat_send_or_cont`: LOCAL_OUT again with `ipvs_property` set, so IPVS's own hooks
//! skip it, then POSTROUTING): the request never sees FORWARD, nor nat INPUT. A real server
//! that is an address of this host is reached by accepting the rewritten packet (`Local`).
//! `ip_vs_out_hook` (LOCAL_IN 98, LOCAL_OUT -99, FORWARD 100) translates replies back;
//! replies are not simulated yet.

use std::sync::Arc;

use observer_model::{Hook, IpvsStep, Verdict};

use super::{Chooser, Pkt, Simulator, Stage, Walk};
use crate::ipvs::{Forward, RealServer, VirtualService};
use crate::packet::{CtState, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};
use crate::route::RouteDecision;

/// `ip_vs_in_hook`'s priority on LOCAL_IN (NF_IP_PRI_NAT_SRC - 1; IPv6 alike).
pub const IPVS_IN_LOCAL_IN: i32 = 99;
/// `ip_vs_in_hook`'s priority on LOCAL_OUT (NF_IP_PRI_NAT_DST + 2).
pub const IPVS_IN_LOCAL_OUT: i32 = -98;

/// What the walk does after IPVS's step.
pub(super) enum After {
    /// Not IPVS's packet (or delivered to a local real server): the rest of the hook runs.
    Continue,
    /// IPVS sent it: OUTPUT again from the start, then POSTROUTING.
    Sent,
    /// The walk ended here (no real server, unroutable, undecidable).
    Stop,
}

impl Simulator<'_> {
    /// IPVS's `ip_vs_in_hook` at `hook` (LOCAL_IN or LOCAL_OUT), on the packet as the tables
    /// before it left it.
    pub(super) fn ipvs_in(
        &self,
        hook: Hook,
        pkt: &mut Pkt,
        b: &mut Walk,
        ch: &mut Chooser,
    ) -> After {
        let Some(svc) = self.ipvs.lookup(pkt.proto, pkt.dst, pkt.dport, pkt.mark) else {
            return After::Continue;
        };
        let priority = if hook == Hook::LocalIn {
            IPVS_IN_LOCAL_IN
        } else {
            IPVS_IN_LOCAL_OUT
        };
        let mut stage = Stage::open(hook, "ipvs".into(), priority, pkt, None);
        let fresh = pkt.state == CtState::New;
        let flags = pkt.tcp_flags;
        if fresh && pkt.proto == 6 && (flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN)) != TCP_SYN {
            // tcp_conn_schedule: only a SYN opens an IPVS connection.
            stage.note = Some(format!(
                "{}: a TCP packet without an IPVS connection that is not a SYN is not scheduled; it goes on to the local stack",
                svc.name()
            ));
            stage.close(super::TableResult::Verdict(Verdict::Accept), pkt);
            b.stages.push(stage.into_model());
            return After::Continue;
        }
        let candidates: Vec<&RealServer> = svc.candidates().collect();
        let (rs, chosen_by) = if let (false, Some((addr, port))) = (fresh, pkt.ipvs_stored)
            && let Some(rs) = svc
                .real_servers
                .iter()
                .find(|r| r.addr == addr && (port.is_none() || r.port.is_none() || r.port == port))
        {
            (Some(rs), "connection")
        } else if candidates.is_empty() {
            (None, "scheduler")
        } else {
            let by = if !fresh {
                "connection"
            } else if candidates.len() == 1 {
                "only"
            } else if svc.persistent.is_some() {
                "persistence"
            } else {
                "scheduler"
            };
            (Some(pick(svc, &candidates, ch)), by)
        };
        let Some(rs) = rs else {
            // ip_vs_leave: no destination: ICMP port unreachable, the packet dropped.
            stage.note = Some(format!(
                "{}: no real server with a weight above 0: IPVS drops the packet and sends ICMP port unreachable",
                svc.name()
            ));
            stage.ipvs = Some(step(svc, None, None, "scheduler", 0));
            stage.close(super::TableResult::Verdict(Verdict::Reject), pkt);
            b.stages.push(stage.into_model());
            b.verdict = Verdict::Reject;
            return After::Stop;
        };
        let count = u32::try_from(candidates.len()).unwrap_or(u32::MAX);
        let mut notes = Vec::new();
        match chosen_by {
            "connection" if pkt.ipvs_stored.is_none() => notes.push(
                "a packet of an existing connection goes where IPVS's connection entry says (`ipvsadm -Lnc`); each real server is listed".to_string(),
            ),
            "persistence" => notes.push(format!(
                "persistent service: a client seen in the last {} s returns to its earlier real server, others are scheduled by {}; each real server is listed",
                svc.persistent.unwrap_or(0),
                svc.scheduler
            )),
            _ => {}
        }
        let local = matches!(self.routes.lookup(rs.addr), RouteDecision::Local { .. })
            || self
                .iface_addrs
                .values()
                .any(|addrs| addrs.contains(&rs.addr));
        let fwd = if local { "Local" } else { rs.forward.name() };
        if rs.forward == Forward::Masq || local {
            pkt.dst = rs.addr;
            pkt.dst_label = None;
            if rs.port.is_some() && pkt.dport.is_some() {
                pkt.dport = rs.port;
            }
        }
        match self.ipvs.conntrack {
            Some(false) => {
                notes.push("net.ipv4.vs.conntrack is 0: IPVS untracks the packet (no nat POSTROUTING, no conntrack entry)".into());
                pkt.state = CtState::Untracked;
                pkt.ct_mark = None;
            }
            Some(true) => {}
            None => notes.push(
                "assumed net.ipv4.vs.conntrack=1 (kube-proxy sets it): the connection keeps its conntrack entry, its reply tuple from the real server".into(),
            ),
        }
        stage.ipvs = Some(step(svc, Some(rs), Some(fwd), chosen_by, count));
        if !notes.is_empty() {
            stage.note = Some(notes.join("; "));
        }
        stage.close(super::TableResult::Verdict(Verdict::Accept), pkt);
        if local {
            b.stages.push(stage.into_model());
            return After::Continue;
        }
        // IPVS routes to the real server itself (__ip_vs_get_out_rt).
        match self.routes.lookup(rs.addr) {
            RouteDecision::Out { dev, .. } => {
                if rs.forward == Forward::Tunnel {
                    // ipip: the tables after IPVS see the outer packet.
                    pkt.src = self
                        .iface_addr(&dev, pkt.v6, true, rs.addr)
                        .unwrap_or(pkt.src);
                    pkt.dst = rs.addr;
                    pkt.proto = if pkt.v6 { 41 } else { 4 };
                    pkt.sport = None;
                    pkt.dport = None;
                    stage.after = pkt.snapshot();
                }
                pkt.in_iface = None;
                pkt.out_iface = Some(dev.clone());
                b.egress = Some(dev);
                b.stages.push(stage.into_model());
                b.ipvs_sent = Some(format!(
                    "sent by IPVS ({fwd}) to {} ({})",
                    rs.endpoint(),
                    svc.name()
                ));
                // The nat core bound the destination at PREROUTING / the first OUTPUT.
                pkt.dst_nat_bound = b.stages.iter().any(|s| {
                    &*s.table == "nat" && matches!(s.hook, Hook::PreRouting | Hook::LocalOut)
                });
                After::Sent
            }
            RouteDecision::Unroutable(why) => {
                b.stages.push(stage.into_model());
                b.verdict = Verdict::Drop;
                b.notes.push(format!(
                    "IPVS cannot route to the real server {}: {why}",
                    rs.endpoint()
                ));
                After::Stop
            }
            RouteDecision::Unknown(why) => {
                b.stages.push(stage.into_model());
                b.verdict = Verdict::Undecidable;
                b.notes.push(format!(
                    "the route to the real server {} is not known: {why}",
                    rs.endpoint()
                ));
                After::Stop
            }
            // A multicast real server: delivered here only on a socket's condition.
            RouteDecision::LocalIf { condition } => {
                b.stages.push(stage.into_model());
                b.verdict = Verdict::Undecidable;
                b.notes.push(format!(
                    "the real server {} is reached only on a condition: {condition}",
                    rs.endpoint()
                ));
                After::Stop
            }
            RouteDecision::Local { .. } => unreachable!("local real servers are handled above"),
        }
    }
}

/// One real server per branch: each candidate in turn, with its long-run share (weights
/// for weighted schedulers, equal for `rr`; for the others the share depends on load, and
/// the branches' probabilities are the weights' shares, said as such nowhere else).
fn pick<'s>(svc: &VirtualService, c: &[&'s RealServer], ch: &mut Chooser) -> &'s RealServer {
    let weight = |r: &RealServer| {
        if svc.scheduler == "rr" {
            1.0
        } else {
            f64::from(r.weight)
        }
    };
    let mut left: f64 = c.iter().map(|r| weight(r)).sum();
    for (i, r) in c.iter().enumerate() {
        if i + 1 == c.len() {
            return r;
        }
        let w = weight(r);
        if ch.choose(w / left) {
            return r;
        }
        left -= w;
    }
    c[0]
}

fn step(
    svc: &VirtualService,
    rs: Option<&RealServer>,
    fwd: Option<&str>,
    chosen_by: &str,
    candidates: u32,
) -> Arc<IpvsStep> {
    Arc::new(IpvsStep {
        service: svc.name(),
        scheduler: svc.scheduler.clone(),
        real_server: rs.map(RealServer::endpoint),
        forward: fwd.map(str::to_string),
        weight: rs.map(|r| r.weight),
        chosen_by: chosen_by.into(),
        candidates,
    })
}
