//! One packet's journey across nodes, predicted (`kubectl observer trace --predict`): the
//! source node's ruleset walked by the simulator with the packet from the pod (entering by
//! the pod's veth, the device the node routes the pod's address to), then, when it leaves
//! through a VXLAN device, the VXLAN packet the node sends (OUTPUT, to the peer VTEP its
//! neighbour and forwarding-database entries name) and receives on the node holding that
//! underlay address (PREROUTING, INPUT), then the carried packet on that node entering from
//! its overlay device. Each leg is the model's traversal (`source: predicted`), stitched
//! in the shape of an observed journey ([`observer_model::stitch::Journey`]). Pure code over
//! the nodes' texts: no kernel.

use std::net::IpAddr;

use observer_model::stitch::{self, Journey, Leg, LegRole};
use observer_model::traversal::Traversal;
use observer_model::{Endpoint, MarkDictionary};
use serde_json::Value;

use crate::live::LiveNode;
use crate::packet::PacketSpec;
use crate::route::RouteDecision;

/// The packet to predict: from a pod's address, to a pod or a ClusterIP.
#[derive(Debug, Clone, PartialEq)]
pub struct Ask {
    /// The node the source pod runs on.
    pub node: String,
    /// The packet as the pod sends it (its interface is found from the node's routes).
    pub packet: PacketSpec,
}

/// A node's VXLAN device, from `ip -j -d link show`.
#[derive(Debug, Clone, PartialEq)]
struct Vxlan {
    vni: u32,
    port: u16,
    local: Option<IpAddr>,
}

/// The node's links (`ip -j -d link show`).
fn links(node: &LiveNode) -> Option<Vec<Value>> {
    serde_json::from_str(node.texts.bridge.links.as_deref()?).ok()
}

/// The VXLAN device a link is, if it is one.
fn vxlan_of(l: &Value) -> Option<Vxlan> {
    let info = &l["linkinfo"];
    if info["info_kind"].as_str() != Some("vxlan") {
        return None;
    }
    let d = &info["info_data"];
    Some(Vxlan {
        vni: u32::try_from(d["id"].as_u64()?).ok()?,
        port: d["port"]
            .as_u64()
            .or_else(|| d["dstport"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
            .unwrap_or(8472),
        local: d["local"].as_str().and_then(|a| a.parse().ok()),
    })
}

fn vxlan_device(node: &LiveNode, dev: &str) -> Option<Vxlan> {
    vxlan_of(
        links(node)?
            .iter()
            .find(|l| l["ifname"].as_str() == Some(dev))?,
    )
}

/// The underlay address a VXLAN device sends a packet for `gateway` to: the neighbour
/// entry's MAC on `dev`, then the forwarding database's `dst` for that MAC (flanneld's and
/// Calico's permanent entries).
fn vtep_underlay(node: &LiveNode, dev: &str, gateway: IpAddr) -> Option<IpAddr> {
    let neigh: Value = serde_json::from_str(node.texts.bridge.neigh.as_deref()?).ok()?;
    let mac = neigh.as_array()?.iter().find_map(|n| {
        (n["dev"].as_str() == Some(dev)
            && n["dst"].as_str().and_then(|d| d.parse::<IpAddr>().ok()) == Some(gateway))
        .then(|| n["lladdr"].as_str())
        .flatten()
    })?;
    let fdb: Value = serde_json::from_str(node.texts.bridge.fdb.as_deref()?).ok()?;
    fdb.as_array()?.iter().find_map(|f| {
        (f["ifname"].as_str() == Some(dev) && f["mac"].as_str() == Some(mac))
            .then(|| f["dst"].as_str()?.parse().ok())
            .flatten()
    })
}

/// The node (and its interface) that owns `addr`.
fn owner(nodes: &[(String, LiveNode)], addr: IpAddr) -> Option<(&str, &LiveNode, String)> {
    nodes.iter().find_map(|(name, n)| {
        n.iface_addrs
            .iter()
            .find(|(_, a)| a.contains(&addr))
            .map(|(iface, _)| (name.as_str(), n, iface.clone()))
    })
}

fn simulate(node: &LiveNode, p: &PacketSpec, marks: &MarkDictionary) -> Traversal {
    let e = crate::explain::explain_with_bridges(
        &node.ruleset,
        &node.ipsets,
        &node.routes,
        &node.bridges,
        p,
        &node.iface_addrs,
    );
    let mut t = e.to_model(marks, None);
    for f in &node.failures {
        t.notes.push(format!("reading the node: {f}"));
    }
    if e.branches.len() > 1 {
        t.notes.push(format!(
            "{} random outcomes (a service with several endpoints): the journey follows the \
             first, see `branches`",
            e.branches.len()
        ));
    }
    t
}

fn leg(node: &str, role: LegRole, t: &Traversal) -> Leg {
    Leg {
        node: node.to_string(),
        role,
        report: serde_json::to_value(t).unwrap_or(Value::Null),
    }
}

fn ip_of(e: &Endpoint) -> Option<IpAddr> {
    match &e.host {
        observer_model::packet::Host::Ip(a) => Some(*a),
        _ => None,
    }
}

/// The packet as the traversal left it: (src, sport, dst, dport).
fn left(t: &Traversal) -> Option<(IpAddr, Option<u16>, IpAddr, Option<u16>)> {
    let p = t.packet.as_ref()?;
    let h = p.last.as_ref().unwrap_or(&p.first);
    Some((ip_of(&h.src)?, h.src.port, ip_of(&h.dst)?, h.dst.port))
}

/// The journey so far: its legs (the source's first) and what the prediction assumed.
#[derive(Default)]
struct Partial {
    legs: Vec<Leg>,
    notes: Vec<String>,
}

impl Partial {
    /// The journey as it ends here: whole, or with what the next leg lacks.
    fn end(self, missing: Option<String>) -> Journey {
        let last = self.legs.last().expect("a source leg");
        Journey {
            end: Some(stitch::end_of(&last.node, &last.report)),
            complete: missing.is_none(),
            missing,
            legs: self.legs,
            predicted: true,
            notes: self.notes,
        }
    }
}

/// Predicts `ask`'s journey over `nodes` (each node's name and what its agent read).
pub fn predict(
    ask: &Ask,
    nodes: &[(String, LiveNode)],
    marks: &MarkDictionary,
) -> Result<Journey, String> {
    let (_, src_node) = nodes
        .iter()
        .find(|(n, _)| *n == ask.node)
        .ok_or_else(|| format!("no ruleset of node {} (the source pod's node)", ask.node))?;
    let mut j = Partial::default();
    // The pod's packet enters the node by the device its address is routed to (its veth).
    let in_iface = match src_node.routes.lookup(ask.packet.src) {
        RouteDecision::Out { dev, .. } => dev,
        other => {
            return Err(format!(
                "node {} has no route to the pod's address {} by a device ({other:?}): \
                 cannot tell which interface its packets enter by",
                ask.node, ask.packet.src
            ));
        }
    };
    let mut p = ask.packet.clone();
    p.in_iface = Some(in_iface);
    if p.sport.is_none() && p.has_ports() {
        j.notes.push(
            "the source port is not known (the pod's socket picks it): rules matching it are \
             undecidable"
                .into(),
        );
    }
    let t = simulate(src_node, &p, marks);
    j.legs.push(leg(&ask.node, LegRole::Source, &t));
    if t.fate.kind != observer_model::FateKind::Forwarded {
        return Ok(j.end(None));
    }
    let Some((isrc, isport, idst, idport)) = left(&t) else {
        return Ok(j.end(Some("the packet's headers as it left are not known".into())));
    };
    let Some(out) = t.egress.as_ref().map(|e| e.iface.clone()) else {
        return Ok(j.end(Some("the device it leaves by is not known".into())));
    };
    let gateway = match src_node.routes.lookup(idst) {
        RouteDecision::Out { gateway, .. } => gateway,
        _ => None,
    };
    let Some(gateway) = gateway else {
        return Ok(j.end(Some(format!(
            "it leaves {} through {out} with no gateway: the next node is not known",
            ask.node
        ))));
    };
    let (next, next_node, next_in) = if let Some(vx) = vxlan_device(src_node, &out) {
        let Some(under_dst) = vtep_underlay(src_node, &out, gateway) else {
            return Ok(j.end(Some(format!(
                "{out} (VXLAN) has no neighbour and forwarding-database entry for {gateway}: \
                     the node it is sent to is not known"
            ))));
        };
        let under_src = vx
            .local
            .or_else(|| match src_node.routes.lookup(under_dst) {
                RouteDecision::Out { prefsrc, .. } => prefsrc,
                _ => None,
            });
        let Some(under_src) = under_src else {
            return Ok(j.end(Some(format!(
                "the underlay source address of {out} is not known"
            ))));
        };
        j.notes.push(
            "the VXLAN packet's UDP source port is the kernel's hash of the inner flow: not \
             predicted, rules matching it are undecidable"
                .into(),
        );
        let inner = observer_model::traversal::Quoted {
            src: Endpoint::new(isrc, isport),
            dst: Endpoint::new(idst, idport),
            proto: observer_model::Protocol::from_number(ask.packet.proto),
        };
        let encap = |direction, overlay: Option<String>| observer_model::traversal::Encapsulation {
            kind: "vxlan",
            direction: Some(direction),
            vni: vx.vni,
            outer_src: Endpoint::new(under_src, None),
            outer_dst: Endpoint::new(under_dst, Some(vx.port)),
            inner: inner.clone(),
            overlay,
            inner_ip_id: None,
        };
        // Sent by the node itself (OUTPUT, POSTROUTING).
        let carrier = PacketSpec::new(17, under_src, None, under_dst, Some(vx.port));
        let mut c = simulate(src_node, &carrier, marks);
        c.encap = Some(encap("encapsulated", Some(out.clone())));
        j.legs.push(leg(&ask.node, LegRole::Carrier, &c));
        if c.fate.kind != observer_model::FateKind::Sent {
            return Ok(j.end(None));
        }
        let Some((name, node, under_in)) = owner(nodes, under_dst) else {
            return Ok(j.end(Some(format!(
                "no node whose ruleset was read holds {under_dst} (the VXLAN packet's \
                     destination)"
            ))));
        };
        let mut arrived = carrier.clone();
        arrived.in_iface = Some(under_in);
        let mut c2 = simulate(node, &arrived, marks);
        // The overlay device of that node with the same VNI receives it.
        let overlay = node_vxlan(node, vx.vni);
        c2.encap = Some(encap("decapsulated", overlay.clone()));
        j.legs.push(leg(name, LegRole::Carrier, &c2));
        if c2.fate.kind != observer_model::FateKind::Delivered {
            return Ok(j.end(None));
        }
        let Some(overlay) = overlay else {
            return Ok(j.end(Some(format!(
                "node {name} has no VXLAN device with VNI {}",
                vx.vni
            ))));
        };
        (
            PacketSpec::new(ask.packet.proto, isrc, isport, idst, idport),
            name,
            overlay,
        )
    } else {
        // A routed network: the node that owns the gateway, entering by that interface.
        let Some((name, _, iface)) = owner(nodes, gateway) else {
            return Ok(j.end(Some(format!(
                "no node whose ruleset was read holds the gateway {gateway}"
            ))));
        };
        (
            PacketSpec::new(ask.packet.proto, isrc, isport, idst, idport),
            name,
            iface,
        )
    };
    let node = &nodes
        .iter()
        .find(|(n, _)| n == next_node)
        .expect("found above")
        .1;
    let mut next = next;
    next.in_iface = Some(next_in);
    let d = simulate(node, &next, marks);
    j.legs.push(leg(next_node, LegRole::Destination, &d));
    Ok(j.end(None))
}

/// The VXLAN device of `node` with this VNI.
fn node_vxlan(node: &LiveNode, vni: u32) -> Option<String> {
    links(node)?.iter().find_map(|l| {
        (vxlan_of(l)?.vni == vni).then(|| l["ifname"].as_str().map(str::to_string))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::{BridgeTexts, LiveTexts};

    const NODE_RULES: &str = include_str!("../../lab/overlay-node.rules");
    const NODE2_RULES: &str = include_str!("../../lab/overlay-node2.rules");

    /// One node of the two-node lab as its agent reads it (`ip -j ...` texts cut to what
    /// matters): `n` 1 or 2.
    fn lab_node(n: u8, rules: &str) -> LiveNode {
        let (me, peer) = (n - 1, 2 - n);
        let (port, peer_mac) = if n == 1 {
            ("cali1a2b", "0a:58:0a:f4:01:00")
        } else {
            ("cali3c4d", "0a:58:0a:f4:00:00")
        };
        let routes = format!(
            r#"[{{"dst":"10.244.{me}.5","dev":"{port}","scope":"link","flags":[]}},
               {{"dst":"10.244.{peer}.0/24","gateway":"10.244.{peer}.0","dev":"flannel.1","flags":["onlink"]}},
               {{"dst":"192.168.60.0/24","dev":"eth0","protocol":"kernel","scope":"link","prefsrc":"192.168.60.{n}","flags":[]}},
               {{"type":"local","dst":"192.168.60.{n}","table":"local","dev":"eth0","scope":"host","prefsrc":"192.168.60.{n}","flags":[]}},
               {{"type":"local","dst":"10.244.{me}.0","table":"local","dev":"flannel.1","scope":"host","prefsrc":"10.244.{me}.0","flags":[]}},
               {{"type":"local","dst":"169.254.1.1","table":"local","dev":"{port}","scope":"host","prefsrc":"169.254.1.1","flags":[]}}]"#
        );
        let addrs = format!(
            r#"[{{"ifname":"eth0","addr_info":[{{"local":"192.168.60.{n}"}}]}},
               {{"ifname":"{port}","addr_info":[{{"local":"169.254.1.1"}}]}},
               {{"ifname":"flannel.1","addr_info":[{{"local":"10.244.{me}.0"}}]}}]"#
        );
        let links = format!(
            r#"[{{"ifname":"eth0"}},{{"ifname":"{port}"}},
               {{"ifname":"flannel.1","linkinfo":{{"info_kind":"vxlan","info_data":{{"id":1,"local":"192.168.60.{n}","port":4789}}}}}}]"#
        );
        let peer_n = 3 - n;
        LiveNode::parse(LiveTexts {
            iptables: Some(rules.to_string()),
            routes: vec![routes],
            addrs: Some(addrs),
            bridge: Box::new(BridgeTexts {
                links: Some(links),
                neigh: Some(format!(
                    r#"[{{"dst":"10.244.{peer}.0","dev":"flannel.1","lladdr":"{peer_mac}","state":["PERMANENT"]}}]"#
                )),
                fdb: Some(format!(
                    r#"[{{"mac":"{peer_mac}","ifname":"flannel.1","dst":"192.168.60.{peer_n}","flags":["self"],"state":"permanent"}}]"#
                )),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    fn lab() -> Vec<(String, LiveNode)> {
        vec![
            ("lab-node".into(), lab_node(1, NODE_RULES)),
            ("lab-node2".into(), lab_node(2, NODE2_RULES)),
        ]
    }

    fn ask(proto: u8, dport: u16) -> Ask {
        Ask {
            node: "lab-node".into(),
            packet: PacketSpec::new(
                proto,
                "10.244.0.5".parse().unwrap(),
                Some(40000),
                "10.96.0.30".parse().unwrap(),
                Some(dport),
            ),
        }
    }

    fn roles(j: &Journey) -> Vec<(&str, LegRole)> {
        j.legs.iter().map(|l| (l.node.as_str(), l.role)).collect()
    }

    #[test]
    fn the_service_packet_is_predicted_across_the_overlay_and_dropped_by_node2s_policy() {
        let nodes = lab();
        for n in &nodes {
            assert!(n.1.failures.is_empty(), "{:?}", n.1.failures);
        }
        let j = predict(&ask(17, 9), &nodes, &MarkDictionary::default()).unwrap();
        assert!(j.predicted && j.complete, "{j:#?}");
        assert_eq!(
            roles(&j),
            [
                ("lab-node", LegRole::Source),
                ("lab-node", LegRole::Carrier),
                ("lab-node2", LegRole::Carrier),
                ("lab-node2", LegRole::Destination)
            ]
        );
        let src = &j.legs[0].report;
        assert_eq!(src["source"], "predicted");
        assert_eq!(src["ingress"]["iface"], "cali1a2b");
        assert_eq!(src["nat"][0]["to"], "10.244.1.5:9");
        assert_eq!(src["egress"]["iface"], "flannel.1");
        let (sent, got) = (&j.legs[1].report, &j.legs[2].report);
        assert_eq!(sent["encap"]["outer_dst"], "192.168.60.2:4789");
        assert_eq!(sent["encap"]["outer_src"], "192.168.60.1");
        assert_eq!(sent["fate"]["kind"], "sent");
        assert_eq!(got["ingress"]["iface"], "eth0");
        assert_eq!(got["fate"]["kind"], "delivered");
        assert_eq!(got["encap"]["overlay"], "flannel.1");
        assert_eq!(got["encap"]["inner"]["dst"], "10.244.1.5:9");
        let dst = &j.legs[3].report;
        assert_eq!(dst["ingress"]["iface"], "flannel.1");
        assert_eq!(dst["packet"]["dst"], "10.244.1.5");
        let end = j.end.as_ref().unwrap();
        assert_eq!(
            (
                end.node.as_str(),
                end.kind.as_str(),
                end.hook.as_deref(),
                end.table.as_deref()
            ),
            ("lab-node2", "dropped", Some("FORWARD"), Some("filter"))
        );
        assert!(
            end.rule
                .as_deref()
                .unwrap()
                .starts_with("-A cali-tw-cali3c4d -p udp -m udp --dport 9"),
            "{end:?}"
        );
        let text = stitch::render(&j);
        assert!(text.starts_with("PREDICTED"), "{text}");
        assert!(
            text.contains("predicted end: dropped on lab-node2"),
            "{text}"
        );
    }

    #[test]
    fn tcp_80_is_predicted_delivered_to_the_endpoint_and_without_the_peer_it_is_incomplete() {
        let nodes = lab();
        let j = predict(&ask(6, 80), &nodes, &MarkDictionary::default()).unwrap();
        assert!(j.complete, "{j:#?}");
        let end = j.end.as_ref().unwrap();
        assert_eq!(
            (end.node.as_str(), end.kind.as_str()),
            ("lab-node2", "forwarded")
        );
        assert_eq!(j.legs[3].report["egress"]["iface"], "cali3c4d");
        assert_eq!(j.legs[0].report["nat"][0]["to"], "10.244.1.5:8080");
        // Only the source node's ruleset: the journey stops where that node's knowledge does.
        let one = &nodes[..1];
        let j = predict(&ask(6, 80), one, &MarkDictionary::default()).unwrap();
        assert!(!j.complete);
        assert_eq!(j.legs.len(), 2, "{j:#?}");
        assert!(
            j.missing.as_deref().unwrap().contains("192.168.60.2"),
            "{j:?}"
        );
        // A source node not read is an error naming it.
        let mut a = ask(6, 80);
        a.node = "elsewhere".into();
        assert!(
            predict(&a, &nodes, &MarkDictionary::default())
                .unwrap_err()
                .contains("elsewhere")
        );
    }
}
