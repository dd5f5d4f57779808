//! A frame entering a bridge port, walked the way `net/bridge/br_netfilter_hooks.c` walks it:
//! bridge PREROUTING chains, then (br_netfilter, when `bridge-nf-call-iptables` is on) the
//! IP PREROUTING hook with the bridge as input device, then the bridge's decision: forward
//! to a port (IP FORWARD and POSTROUTING with the bridge as both devices and `physdev` in and
//! out known), deliver to the bridge device (routed: INPUT, or FORWARD out of another
//! device), or, when DNAT moved the destination, route the new one and bridge again when it
//! lies behind the same bridge (`br_nf_pre_routing_finish_bridge`). Bridge-family nft chains
//! run where the kernel runs them around br_netfilter's own hooks.

use super::{
    Chooser, Hook, NfBridge, PhysOut, Pkt, Simulator, Stage, Tri, Verdict, Walk, iface_match,
};
use crate::compile::Physdev;
use crate::packet::PacketSpec;
use crate::route::RouteDecision;
use observer_model::Route;

/// Where the bridge sends the frame after PREROUTING.
enum Decision {
    /// Forwarded by the bridge to a port; `resolved` false when the neighbour of a DNAT
    /// target must be resolved first.
    Bridged {
        out: PhysOut,
        resolved: bool,
    },
    /// Up to the bridge device and delivered locally.
    Local,
    /// Up to the bridge device and routed out of `dev`.
    Routed(String),
    /// Routing drops it.
    Unroutable(String),
    Undecidable(String),
}

/// br_netfilter's own priority on the bridge hooks (`NF_BR_PRI_BRNF`).
const BRNF: i32 = 0;

impl Simulator<'_> {
    /// `xt_physdev`'s match: without br_netfilter's record only inverted options match; in
    /// PREROUTING no out port is known yet (`--physdev-is-bridged` fails there).
    pub(super) fn physdev(&self, p: &Physdev, pkt: &Pkt) -> Tri {
        if !self.bridges.is_known() && !pkt.nf_bridge_observed {
            return Tri::Unknown(
                "physdev needs the bridge ports (--bridge-links / --links, or --live)".into(),
            );
        }
        if !pkt.nf_bridge_known {
            return Tri::Unknown(
                "physdev: the bridge ports this packet passed are not known here".into(),
            );
        }
        let Some(nb) = &pkt.nf_bridge else {
            let all_inverted = [p.is_bridged, p.is_in, p.is_out]
                .iter()
                .flatten()
                .all(|neg| *neg)
                && [&p.physin, &p.physout]
                    .iter()
                    .all(|o| o.as_ref().is_none_or(|(_, neg)| *neg));
            return if all_inverted { Tri::Yes } else { Tri::No };
        };
        // Bridged to a port not named: that there is one is known, which one is not.
        let (out_present, outdev) = match &nb.physout {
            PhysOut::None => (false, Ok(None)),
            PhysOut::Port(o) => (true, Ok(Some(o.as_str()))),
            PhysOut::Unknown(why) => (true, Err(why)),
        };
        if let Some(neg) = p.is_bridged
            && out_present == neg
        {
            return Tri::No;
        }
        // The in port is always known once br_netfilter has the frame.
        if p.is_in == Some(true) {
            return Tri::No;
        }
        if let Some(neg) = p.is_out
            && out_present == neg
        {
            return Tri::No;
        }
        // A flooded copy's in port is not known: `--physdev-in` undecidable, unless the
        // out port already fails the rule.
        let mut physin_unknown = None;
        if let Some((name, neg)) = &p.physin {
            match &nb.physin {
                Some(i) if iface_match(name, Some(i)) == *neg => return Tri::No,
                Some(_) => {}
                None => {
                    physin_unknown = Some(Tri::Unknown(
                        "physdev-in: the port a flooded copy came in by is not known".into(),
                    ))
                }
            }
        }
        let out = match (&p.physout, outdev) {
            (None, _) => Tri::Yes,
            (Some(_), Err(why)) => Tri::Unknown(why.clone()),
            (Some(_), Ok(None)) => Tri::No,
            (Some((name, neg)), Ok(Some(o))) => {
                if iface_match(name, Some(o)) != *neg {
                    Tri::Yes
                } else {
                    Tri::No
                }
            }
        };
        match (out, physin_unknown) {
            (Tri::No, _) => Tri::No,
            (_, Some(unknown)) => unknown,
            (out, None) => out,
        }
    }

    /// Runs the bridge-family base chains of `hook` whose priority `keep` accepts, with the
    /// bridge ports as devices; false when the frame stopped.
    fn run_bridge_chains(
        &self,
        hook: Hook,
        keep: impl Fn(i32) -> bool,
        on: OnBridge,
        pkt: &mut Pkt,
        b: &mut Walk,
        ch: &mut Chooser,
    ) -> bool {
        let Some(prog) = &self.nft else {
            return true;
        };
        let saved = (pkt.in_iface.clone(), pkt.out_iface.clone(), pkt.bridged);
        pkt.in_iface = on.in_port.map(str::to_string);
        pkt.out_iface = on.out_port.map(str::to_string);
        pkt.bridge_family = Some(on.bridge.to_string());
        let mut go_on = true;
        for s in prog
            .bridge_chains(hook)
            .into_iter()
            .filter(|s| keep(s.priority))
        {
            let t = &prog.tables[s.table];
            let mut stage = Stage::open(
                hook,
                t.id.name.clone(),
                s.priority,
                pkt,
                Some((t.id.family.clone(), t.chains[s.chain].name.clone())),
            );
            let res = self.run_nft_chain(s, hook, pkt, &mut stage, ch);
            let v = stage.close(res, pkt);
            b.stages.push(stage.into_model());
            if v != Verdict::Accept {
                b.verdict = v;
                go_on = false;
                break;
            }
        }
        pkt.bridge_family = None;
        (pkt.in_iface, pkt.out_iface, pkt.bridged) = saved;
        go_on
    }

    /// Where the bridge sends the frame once PREROUTING is done: `dnat` when the IP hooks
    /// changed the destination address (the kernel compares addresses only, not ports).
    fn bridge_decision(&self, spec: &PacketSpec, pkt: &Pkt, bridge: &str, dnat: bool) -> Decision {
        if let Some(out) = &spec.out_iface {
            return if self.bridges.bridge_of(out) == Some(bridge) {
                Decision::Bridged {
                    out: PhysOut::Port(out.clone()),
                    resolved: !dnat || self.bridges.neigh_usable(bridge, pkt.dst) != Some(false),
                }
            } else {
                Decision::Routed(out.clone())
            };
        }
        if spec.local {
            return Decision::Local;
        }
        if self.routes.is_empty() {
            return Decision::Undecidable(
                "no routes given and no `out IFACE`: cannot tell bridged from routed".into(),
            );
        }
        match self.routes.lookup(pkt.dst) {
            // `lookup` never returns LocalIf (only `input` does).
            RouteDecision::Local { .. } | RouteDecision::LocalIf { .. } => Decision::Local,
            // Behind the same bridge: without DNAT the sender addressed the frame to the
            // destination's own MAC (it is on-link for the sender); after DNAT the kernel
            // sees the route leave by the bridge it came in on and bridges it again.
            RouteDecision::Out { dev, .. } if dev == bridge => {
                match self.bridges.port_for(bridge, pkt.dst) {
                    Ok((port, resolved)) => Decision::Bridged {
                        out: PhysOut::Port(port),
                        resolved: resolved || !dnat,
                    },
                    Err(why) => Decision::Bridged {
                        out: PhysOut::Unknown(why),
                        resolved: true,
                    },
                }
            }
            RouteDecision::Out { dev, .. } => Decision::Routed(dev),
            RouteDecision::Unroutable(why) => Decision::Unroutable(why),
            RouteDecision::Unknown(why) => Decision::Undecidable(why),
        }
    }

    /// A routed packet leaving by a bridge device is transmitted by the bridge (`br_dev_xmit`):
    /// its bridge OUTPUT and POSTROUTING chains run, with the port the next hop is behind.
    pub(super) fn leave_by_bridge(&self, pkt: &mut Pkt, b: &mut Walk, ch: &mut Chooser) {
        let Some(bridge) = b.egress.clone().filter(|e| self.bridges.is_bridge(e)) else {
            return;
        };
        let next_hop = match self.routes.lookup(pkt.dst) {
            RouteDecision::Out {
                gateway: Some(g), ..
            } => g,
            _ => pkt.dst,
        };
        let port = self.bridges.port_for(&bridge, next_hop);
        let port_in = b.bridge.as_ref().and_then(|(_, i, _)| i.clone());
        b.bridge = Some((
            bridge.clone(),
            port_in,
            port.as_ref().ok().map(|p| p.0.clone()),
        ));
        let hooks = [Hook::LocalOut, Hook::PostRouting];
        let Some(prog) = &self.nft else { return };
        if hooks.iter().all(|h| prog.bridge_chains(*h).is_empty()) {
            return;
        }
        let port = match port {
            Ok((port, _)) => port,
            Err(why) => {
                b.verdict = Verdict::Undecidable;
                b.notes.push(format!(
                    "the bridge {bridge}'s own chains run next, but the port is not known: {why}"
                ));
                return;
            }
        };
        b.notes
            .push(format!("sent through {bridge}: leaves by port {port}"));
        for hook in hooks {
            if !self.run_bridge_chains(
                hook,
                |_| true,
                OnBridge::new(&bridge, None, Some(&port)),
                pkt,
                b,
                ch,
            ) {
                return;
            }
        }
    }

    /// The br_netfilter path of a frame entering `port` of `bridge`.
    pub(super) fn walk_bridged(
        &self,
        spec: &PacketSpec,
        mut pkt: Pkt,
        mut b: Walk,
        ch: &mut Chooser,
        port: &str,
        bridge: &str,
    ) -> Walk {
        let fam = usize::from(pkt.v6);
        b.bridge = Some((bridge.to_string(), Some(port.to_string()), None));
        let (calls, assumed) = self.bridges.calls_ip_hooks(bridge, pkt.v6);
        let sysctl = if pkt.v6 {
            "net.bridge.bridge-nf-call-ip6tables"
        } else {
            "net.bridge.bridge-nf-call-iptables"
        };
        if assumed {
            b.notes.push(format!(
                "{sysctl} not given: the kernel's default (1) is assumed, so bridged frames walk the IP hooks"
            ));
        }
        let inbound = OnBridge::new(bridge, Some(port), None);
        // Bridge PREROUTING chains before br_netfilter's hook (at equal priority a chain is
        // taken as registered after the bridge, so it runs first).
        if !self.run_bridge_chains(
            Hook::PreRouting,
            |p| p <= BRNF,
            inbound,
            &mut pkt,
            &mut b,
            ch,
        ) {
            return b;
        }
        let orig_dst = pkt.dst;
        if calls {
            pkt.nf_bridge = Some(NfBridge {
                physin: Some(port.to_string()),
                physout: PhysOut::None,
            });
            // setup_pre_routing: the bridge is the input device of the IP hooks.
            pkt.in_iface = Some(bridge.to_string());
            if !self.run_hook(fam, Hook::PreRouting, &mut pkt, &mut b, ch, None) {
                return b;
            }
        } else {
            b.notes.push(format!(
                "{sysctl} is 0 and {bridge} does not set it itself: bridged frames skip the IP hooks"
            ));
        }
        // br_nf_hook_thresh: the bridge PREROUTING chains after br_netfilter.
        if !self.run_bridge_chains(
            Hook::PreRouting,
            |p| p > BRNF,
            inbound,
            &mut pkt,
            &mut b,
            ch,
        ) {
            return b;
        }
        let dnat = pkt.dst != orig_dst;
        let decision = self.bridge_decision(spec, &pkt, bridge, dnat);
        // Up to the bridge device (to it, or routed by it): its `input` chains first.
        if matches!(decision, Decision::Local | Decision::Routed(_))
            && !self.run_bridge_chains(Hook::LocalIn, |_| true, inbound, &mut pkt, &mut b, ch)
        {
            return b;
        }
        match decision {
            Decision::Bridged { out, resolved } => {
                self.bridged(pkt, b, ch, port, bridge, out, (dnat, resolved), calls)
            }
            Decision::Local | Decision::Routed(_) if !calls => {
                // An ordinary received packet of the bridge, its PREROUTING included (no
                // br_netfilter record, nothing sabotaged).
                let mut spec = spec.clone();
                spec.in_iface = Some(bridge.to_string());
                b.notes.push(format!(
                    "addressed to {bridge} itself: passed up from port {port} and routed"
                ));
                let mut r = self.walk(&spec, &pkt.stored, ch);
                r.notes.splice(0..0, b.notes);
                r.stages.splice(0..0, b.stages);
                r
            }
            Decision::Local => {
                b.route = Some(Route::Input);
                b.notes.push(format!(
                    "routed, not bridged: {bridge} takes the frame from port {port} and delivers it locally"
                ));
                pkt.out_iface = None;
                self.run_hook(fam, Hook::LocalIn, &mut pkt, &mut b, ch, None);
                b
            }
            Decision::Routed(dev) => {
                b.route = Some(Route::Forward);
                b.notes.push(format!(
                    "routed, not bridged: {bridge} takes the frame from port {port} and routes it out of {dev}"
                ));
                pkt.out_iface = Some(dev.clone());
                b.egress = Some(dev);
                for hook in [Hook::Forward, Hook::PostRouting] {
                    if !self.run_hook(fam, hook, &mut pkt, &mut b, ch, None) {
                        return b;
                    }
                }
                self.leave_by_bridge(&mut pkt, &mut b, ch);
                b
            }
            Decision::Unroutable(why) => {
                b.route = Some(Route::Unroutable);
                b.verdict = Verdict::Drop;
                b.notes.push(format!("routing drops the packet: {why}"));
                b
            }
            Decision::Undecidable(why) => {
                b.route = Some(Route::Unknown);
                b.verdict = Verdict::Undecidable;
                b.notes.push(why);
                b
            }
        }
    }

    /// The bridge forwards the frame to `out`: bridge FORWARD chains, IP FORWARD (bridge in,
    /// bridge out, `physdev` both ways), bridge POSTROUTING chains, IP POSTROUTING (no input
    /// device).
    #[expect(
        clippy::too_many_arguments,
        reason = "the walk state is threaded explicitly, as in run_hook"
    )]
    fn bridged(
        &self,
        mut pkt: Pkt,
        mut b: Walk,
        ch: &mut Chooser,
        port: &str,
        bridge: &str,
        out: PhysOut,
        (dnat, resolved): (bool, bool),
        calls: bool,
    ) -> Walk {
        let fam = usize::from(pkt.v6);
        b.route = Some(Route::Bridged);
        let out_name = match &out {
            PhysOut::Port(p) => Some(p.clone()),
            _ => None,
        };
        b.egress = out_name.clone();
        b.notes.push(format!(
            "bridged by {bridge}: in port {port}, out port {}",
            out_name.as_deref().unwrap_or("unknown")
        ));
        if let PhysOut::Unknown(why) = &out {
            b.notes.push(why.clone());
        }
        if dnat {
            b.notes.push(format!(
                "DNAT moved the destination to an address behind {bridge}: br_nf_pre_routing_finish_bridge hands the frame back to the bridge"
            ));
            if !resolved {
                b.notes.push(format!(
                    "the neighbour of {} is not resolved: the first packet is queued while the node resolves it and leaves through {bridge}'s own transmit, then is bridged (the same chains run)",
                    pkt.dst
                ));
            }
        }
        // br_forward: a frame goes back out of its in port only with hairpin mode.
        if out_name.as_deref() == Some(port) {
            match self.bridges.ports.get(port).and_then(|p| p.hairpin) {
                Some(true) => b.notes.push(format!(
                    "hairpin: {port} has hairpin mode on, the frame goes back out of it"
                )),
                Some(false) => {
                    b.verdict = Verdict::Drop;
                    b.notes.push(format!(
                        "the bridge drops the frame: it would leave by its in port {port}, which has hairpin mode off"
                    ));
                    return b;
                }
                None => {
                    b.verdict = Verdict::Undecidable;
                    b.notes.push(format!(
                        "the frame would leave by its in port {port}: whether it has hairpin mode is not known (pass `bridge -j -d link`)"
                    ));
                    return b;
                }
            }
        }
        let out_port = out_name.as_deref();
        if let PhysOut::Unknown(why) = &out {
            pkt.out_port_unknown =
                Some(format!("the bridge port it leaves by is not known ({why})"));
        }
        b.bridge = Some((bridge.to_string(), Some(port.to_string()), out_name.clone()));
        let through = OnBridge::new(bridge, Some(port), out_port);
        let outbound = OnBridge::new(bridge, None, out_port);
        // Bridge FORWARD chains before br_netfilter's forward hook (priority 0 on this kernel,
        // -1 on older ones; at equal priority a chain is taken as registered after the
        // bridge, so it runs first: the kernel's counters agree), the ones above after it.
        if !self.run_bridge_chains(Hook::Forward, |p| p <= BRNF, through, &mut pkt, &mut b, ch) {
            return b;
        }
        if calls {
            if let Some(nb) = &mut pkt.nf_bridge {
                nb.physout = out.clone();
            }
            pkt.in_iface = Some(bridge.to_string());
            pkt.out_iface = Some(bridge.to_string());
            if !self.run_hook(fam, Hook::Forward, &mut pkt, &mut b, ch, None) {
                return b;
            }
        }
        if !self.run_bridge_chains(Hook::Forward, |p| p > BRNF, through, &mut pkt, &mut b, ch) {
            return b;
        }
        // Bridge POSTROUTING chains, then br_nf_post_routing at the very end.
        if !self.run_bridge_chains(Hook::PostRouting, |_| true, outbound, &mut pkt, &mut b, ch) {
            return b;
        }
        if calls {
            pkt.bridged = true;
            pkt.out_iface = Some(bridge.to_string());
            self.run_hook(fam, Hook::PostRouting, &mut pkt, &mut b, ch, None);
        }
        b
    }
}

/// A frame's place on its bridge: the bridge-family chains see its ports as its devices
/// (`iifname`/`oifname`), none where it has no port on that side.
#[derive(Clone, Copy)]
struct OnBridge<'a> {
    bridge: &'a str,
    in_port: Option<&'a str>,
    out_port: Option<&'a str>,
}

impl<'a> OnBridge<'a> {
    fn new(bridge: &'a str, in_port: Option<&'a str>, out_port: Option<&'a str>) -> Self {
        Self {
            bridge,
            in_port,
            out_port,
        }
    }
}
