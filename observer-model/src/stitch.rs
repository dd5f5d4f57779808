//! One packet followed across nodes: the reports of each node's observer (JSON objects, as
//! agents stream them), stitched into a journey. The source node's traversal of the packet,
//! then, when it left through a VXLAN overlay, the VXLAN packet that carried it on that
//! node and on the next, then the next node's traversal of the packet it carried; or, on a
//! routed network, the next node's traversal of the packet as it left.
//!
//! A packet is recognised on the next node by its identity after NAT: its tuple as it left
//! (protocol, addresses, ports), its IPv4 identification (`packet.ip_id`: NAT keeps it, and
//! a VXLAN packet's report carries the one of the packet inside, `encap.inner_ip_id`), and
//! across an overlay also the outer header (underlay addresses and UDP source port, which
//! the sender derives from the inner flow, the VNI, and the VXLAN packet's own
//! identification). Where a report has no identification (IPv6 has none outside fragments;
//! reports not asked for it), packets of one flow with the same tuple are told apart by
//! order: the n-th carrier after the source's traversal goes with it. Pure code over
//! reports: no kernel, no cluster.

use serde::Serialize;
use serde_json::Value;

/// A report and the node whose observer wrote it, in the order that node wrote them.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeReport {
    pub node: String,
    pub report: Value,
}

/// What a leg of the journey is.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LegRole {
    /// The packet as its sender's node handled it.
    Source,
    /// The VXLAN packet carrying it, on the node that encapsulated it or decapsulated it.
    Carrier,
    /// The packet as the next node handled it.
    Destination,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Leg {
    pub node: String,
    pub role: LegRole,
    pub report: Value,
}

/// The stitched journey: its legs in order, where it ended, and what could not be matched.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Journey {
    pub legs: Vec<Leg>,
    /// The last leg's fate, with its node.
    pub end: Option<End>,
    /// True when every leg the path needs was found.
    pub complete: bool,
    /// Why it is not complete.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing: Option<String>,
    /// True when the legs were predicted from the nodes' rulesets (`explain`), not
    /// observed: no packet was seen.
    pub predicted: bool,
    /// What the prediction assumed or could not decide.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct End {
    pub node: String,
    pub kind: String,
    pub hook: Option<String>,
    pub table: Option<String>,
    /// The rule the packet met last in that table (for a drop: the rule that dropped it).
    pub rule: Option<String>,
}

/// Which packet to follow: the first from `src` to `dst` (a pod's address, or a service's
/// ClusterIP that NAT turns into an endpoint), to `port` when given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub src: String,
    pub dst: Vec<String>,
    pub port: Option<u16>,
    /// The protocol (`tcp`, `udp`), any when None.
    pub proto: Option<String>,
}

/// A tuple as text: (proto, src, sport, dst, dport).
type Tuple = (String, String, u64, String, u64);

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

/// The packet's tuple as first seen.
fn first_tuple(r: &Value) -> Option<Tuple> {
    let p = r.get("packet")?;
    Some((
        text(&p["proto"]),
        text(&p["src"]),
        p["sport"].as_u64().unwrap_or(0),
        text(&p["dst"]),
        p["dport"].as_u64().unwrap_or(0),
    ))
}

/// The packet's tuple as last seen (after NAT).
fn last_tuple(r: &Value) -> Option<Tuple> {
    let (proto, ..) = first_tuple(r)?;
    let p = &r["packet"];
    let l = p.get("last").filter(|l| !l.is_null()).unwrap_or(p);
    Some((
        proto,
        text(&l["src"]),
        l["sport"].as_u64().unwrap_or(0),
        text(&l["dst"]),
        l["dport"].as_u64().unwrap_or(0),
    ))
}

/// `addr:port` (or `addr`) split into the address and the port (0 without one); IPv6
/// addresses come bracketed with a port.
fn split(endpoint: &str) -> (String, u64) {
    if let Some(rest) = endpoint.strip_prefix('[')
        && let Some((a, p)) = rest.split_once("]:")
    {
        return (a.to_string(), p.parse().unwrap_or(0));
    }
    match endpoint.rsplit_once(':') {
        Some((a, p)) if !a.contains(':') => (a.to_string(), p.parse().unwrap_or(0)),
        _ => (endpoint.to_string(), 0),
    }
}

/// The tuple a VXLAN carrier says it carries.
fn carried(r: &Value) -> Option<Tuple> {
    let i = r.get("encap")?.get("inner")?;
    let (s, sp) = split(i["src"].as_str()?);
    let (d, dp) = split(i["dst"].as_str()?);
    Some((text(&i["proto"]), s, sp, d, dp))
}

/// A carrier's outer header and VNI: what both nodes saw of the same underlay packet.
fn outer(r: &Value) -> Option<(String, String, u64)> {
    let e = r.get("encap")?;
    Some((
        text(&e["outer_src"]),
        text(&e["outer_dst"]),
        e["vni"].as_u64()?,
    ))
}

/// The packet's IPv4 identification, when its report carries it.
fn ip_id(r: &Value) -> Option<u64> {
    r["packet"]["ip_id"].as_u64()
}

/// The identification of the packet a VXLAN packet carries.
fn inner_ip_id(r: &Value) -> Option<u64> {
    r["encap"]["inner_ip_id"].as_u64()
}

/// Two identifications of one packet: equal, or one not known (then the tuple and order
/// decide).
fn same_id(a: Option<u64>, b: Option<u64>) -> bool {
    a.is_none() || b.is_none() || a == b
}

fn direction(r: &Value) -> &str {
    r["encap"]["direction"].as_str().unwrap_or("")
}

fn iface(r: &Value, key: &str) -> String {
    text(&r[key]["iface"])
}

fn wanted(w: &Wanted, r: &Value) -> bool {
    let Some((proto, src, _, dst, dport)) = first_tuple(r) else {
        return false;
    };
    r.get("encap").is_none()
        && src == w.src
        && w.dst.contains(&dst)
        && w.port.is_none_or(|p| u64::from(p) == dport)
        && w.proto.as_ref().is_none_or(|p| *p == proto)
}

/// The last rule of the stage where the traversal ended.
pub fn end_of(node: &str, r: &Value) -> End {
    let f = &r["fate"];
    let (hook, table) = (f["hook"].as_str(), f["table"].as_str());
    let rule = r["stages"].as_array().and_then(|stages| {
        stages
            .iter()
            .rev()
            .find(|s| {
                Some(s["hook"].as_str().unwrap_or("")) == hook && s["table"].as_str() == table
            })
            .and_then(|s| s["rules"].as_array()?.last()?["text"].as_str())
            .map(str::to_string)
    });
    End {
        node: node.to_string(),
        kind: text(&f["kind"]),
        hook: hook.map(str::to_string),
        table: table.map(str::to_string),
        rule,
    }
}

/// The reports after index `from`: of `node` only, or of every node but `other`.
fn later<'a>(
    reports: &'a [NodeReport],
    from: usize,
    node: Option<&'a str>,
    other: Option<&'a str>,
) -> impl Iterator<Item = (usize, &'a NodeReport)> {
    reports
        .iter()
        .enumerate()
        .skip(from + 1)
        .filter(move |(_, n)| node.is_none_or(|x| n.node == x) && other.is_none_or(|x| n.node != x))
}

/// Stitches the journey of the first packet `w` describes that every node on its way
/// reported (an observer that started late on the next node misses the first packets), from
/// `reports` of every node (each node's in the order it wrote them); when none was seen
/// whole, the first one's, incomplete and saying what is missing.
pub fn stitch(w: &Wanted, reports: &[NodeReport]) -> Option<Journey> {
    let mut first = None;
    for (at, n) in reports.iter().enumerate() {
        if !wanted(w, &n.report) {
            continue;
        }
        let Some(j) = stitch_from(at, reports) else {
            continue;
        };
        if j.complete {
            return Some(j);
        }
        first.get_or_insert(j);
    }
    first
}

/// The journey of the packet whose source traversal is `reports[at]`.
fn stitch_from(at: usize, reports: &[NodeReport]) -> Option<Journey> {
    let first = &reports[at];
    let mut legs = vec![Leg {
        node: first.node.clone(),
        role: LegRole::Source,
        report: first.report.clone(),
    }];
    let journey = |legs: Vec<Leg>, missing: Option<String>| {
        let last = legs.last().expect("a source leg");
        Some(Journey {
            end: Some(end_of(&last.node, &last.report)),
            complete: missing.is_none(),
            missing,
            legs,
            predicted: false,
            notes: Vec::new(),
        })
    };
    let left = last_tuple(&first.report)?;
    let out = iface(&first.report, "egress");
    let fate = first.report["fate"]["kind"].as_str().unwrap_or("");
    if fate != "forwarded" && fate != "sent" {
        // It ended on its own node: delivered there, or dropped.
        return journey(legs, None);
    }
    let later = |from, node, other| later(reports, from, node, other);
    // Left through an overlay device: the carrier its node sent next.
    let sent = later(at, Some(&first.node), None).find(|(_, n)| {
        direction(&n.report) == "encapsulated"
            && carried(&n.report).as_ref() == Some(&left)
            && same_id(ip_id(&first.report), inner_ip_id(&n.report))
            && n.report["encap"]["overlay"]
                .as_str()
                .is_none_or(|o| o == out)
    });
    let (next_from, next_node, arrived, arrived_id) = if let Some((_, c)) = sent {
        legs.push(Leg {
            node: c.node.clone(),
            role: LegRole::Carrier,
            report: c.report.clone(),
        });
        let id = (outer(&c.report), carried(&c.report));
        let Some((j, r)) = reports.iter().enumerate().find(|(_, n)| {
            n.node != c.node
                && direction(&n.report) == "decapsulated"
                && (outer(&n.report), carried(&n.report)) == id
                && same_id(ip_id(&c.report), ip_id(&n.report))
                && same_id(inner_ip_id(&c.report), inner_ip_id(&n.report))
        }) else {
            return journey(
                legs,
                Some(format!(
                    "no node reported the VXLAN packet {} -> {} (vni {}) arriving",
                    c.report["encap"]["outer_src"],
                    c.report["encap"]["outer_dst"],
                    c.report["encap"]["vni"]
                )),
            );
        };
        legs.push(Leg {
            node: r.node.clone(),
            role: LegRole::Carrier,
            report: r.report.clone(),
        });
        (
            j,
            r.node.clone(),
            r.report["encap"]["overlay"].as_str().map(str::to_string),
            inner_ip_id(&r.report),
        )
    } else {
        (0, String::new(), None, None)
    };
    // The packet itself on the next node: first seen with the tuple it left with (after
    // the carrier when there was one, entering through the overlay device).
    let on_next = if next_node.is_empty() {
        later(at, None, Some(&first.node)).find(|(_, n)| {
            n.report.get("encap").is_none()
                && first_tuple(&n.report) == Some(left.clone())
                && same_id(ip_id(&first.report), ip_id(&n.report))
        })
    } else {
        later(next_from, Some(&next_node), None).find(|(_, n)| {
            n.report.get("encap").is_none()
                && first_tuple(&n.report) == Some(left.clone())
                && same_id(ip_id(&first.report), ip_id(&n.report))
                && same_id(arrived_id, ip_id(&n.report))
                && arrived
                    .as_ref()
                    .is_none_or(|o| iface(&n.report, "ingress") == *o)
        })
    };
    match on_next {
        Some((_, d)) => {
            legs.push(Leg {
                node: d.node.clone(),
                role: LegRole::Destination,
                report: d.report.clone(),
            });
            journey(legs, None)
        }
        None => {
            let (proto, s, sp, d, dp) = &left;
            journey(
                legs,
                Some(format!(
                    "no node reported {proto} {s}:{sp} -> {d}:{dp} after it left {} through {out}",
                    first.node
                )),
            )
        }
    }
}

/// The journey as text: one block per leg, the stages that named rules, then the end.
pub fn render(j: &Journey) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    if j.predicted {
        let _ = writeln!(
            out,
            "PREDICTED from each node's ruleset by `explain` (no packet was observed):"
        );
    }
    for (n, leg) in j.legs.iter().enumerate() {
        let r = &leg.report;
        let p = &r["packet"];
        let _ = write!(
            out,
            "{}. [{}] {:<11} {} {}:{} -> {}:{}{}",
            n + 1,
            leg.node,
            match leg.role {
                LegRole::Source => "source",
                LegRole::Carrier => "overlay",
                LegRole::Destination => "destination",
            },
            text(&p["proto"]),
            text(&p["src"]),
            p["sport"],
            text(&p["dst"]),
            p["dport"],
            p["ip_id"]
                .as_u64()
                .map(|id| format!(" id {id}"))
                .unwrap_or_default()
        );
        for (k, label) in [("ingress", "in"), ("egress", "out")] {
            if let Some(i) = r[k]["iface"].as_str() {
                let _ = write!(out, "  {label} {i}");
            }
        }
        let _ = writeln!(out);
        if let Some(e) = r.get("encap") {
            let _ = writeln!(
                out,
                "     vxlan {} vni {} {} -> {} carrying {} {} -> {} (overlay {})",
                text(&e["direction"]),
                e["vni"],
                text(&e["outer_src"]),
                text(&e["outer_dst"]),
                text(&e["inner"]["proto"]),
                text(&e["inner"]["src"]),
                text(&e["inner"]["dst"]),
                e["overlay"].as_str().unwrap_or("?"),
            );
        }
        for nat in r["nat"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "     {} {} -> {} at {} {}",
                text(&nat["kind"]).to_uppercase(),
                text(&nat["from"]),
                text(&nat["to"]),
                text(&nat["hook"]),
                text(&nat["table"])
            );
        }
        for s in r["stages"].as_array().into_iter().flatten() {
            for rule in s["rules"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    out,
                    "     {:<11} {:<8} {}",
                    text(&s["hook"]),
                    text(&s["table"]),
                    text(&rule["text"])
                );
            }
        }
        let f = &r["fate"];
        let _ = writeln!(
            out,
            "     => {}{}",
            text(&f["kind"]),
            f["reason"]
                .as_str()
                .map(|x| format!(" ({x})"))
                .unwrap_or_default()
        );
    }
    if let Some(e) = &j.end {
        let what = if j.predicted { "predicted end" } else { "end" };
        let _ = write!(out, "{what}: {} on {}", e.kind, e.node);
        if let (Some(h), Some(t)) = (&e.hook, &e.table) {
            let _ = write!(out, " in {h} {t}");
        }
        if let Some(rule) = &e.rule {
            let _ = write!(out, " by {rule}");
        }
        let _ = writeln!(out);
    }
    if let Some(m) = &j.missing {
        let _ = writeln!(out, "incomplete: {m}");
    }
    for n in &j.notes {
        let _ = writeln!(out, "note: {n}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report(
        proto: &str,
        (src, sport): (&str, u16),
        (dst, dport): (&str, u16),
        last: Option<(&str, &str)>,
        ifaces: (Option<&str>, Option<&str>),
        fate: Value,
        encap: Option<Value>,
    ) -> Value {
        let last = last.map(|(s, d)| {
            let (s, sp) = split(s);
            let (d, dp) = split(d);
            json!({"src": s, "dst": d, "sport": sp, "dport": dp, "icmp": null})
        });
        let mut r = json!({
            "schema": 3, "source": "observed",
            "packet": {"family": "ipv4", "proto": proto, "src": src, "dst": dst,
                       "sport": sport, "dport": dport, "icmp": null, "last": last},
            "ingress": ifaces.0.map(|i| json!({"iface": i})),
            "egress": ifaces.1.map(|i| json!({"iface": i})),
            "stages": [], "fate": fate, "nat": [],
        });
        if let Some(e) = encap {
            r["encap"] = e;
        }
        r
    }

    fn forwarded() -> Value {
        json!({"kind": "forwarded", "hook": "POSTROUTING", "table": null, "reason": null})
    }

    fn vxlan(direction: &str, sport: u16, inner_src: &str, inner_dst: &str, proto: &str) -> Value {
        json!({"kind": "vxlan", "direction": direction, "vni": 1,
               "outer_src": format!("192.168.60.1:{sport}"), "outer_dst": "192.168.60.2:4789",
               "inner": {"src": inner_src, "dst": inner_dst, "proto": proto},
               "overlay": "flannel.1"})
    }

    fn carrier(direction: &str, sport: u16, inner: (&str, &str), proto: &str) -> Value {
        let (route_in, route_out) = if direction == "encapsulated" {
            (None, Some("eth0"))
        } else {
            (Some("eth0"), None)
        };
        report(
            "udp",
            ("192.168.60.1", sport),
            ("192.168.60.2", 4789),
            None,
            (route_in, route_out),
            json!({"kind": "incomplete", "hook": "INPUT", "table": null}),
            Some(vxlan(direction, sport, inner.0, inner.1, proto)),
        )
    }

    fn at(node: &str, report: Value) -> NodeReport {
        NodeReport {
            node: node.into(),
            report,
        }
    }

    /// The two-node lab's udp/9 to the service: DNAT on node-a, carried by VXLAN, dropped by
    /// node-b's policy. Other traffic of both nodes interleaved.
    fn cluster(dropped: bool) -> Vec<NodeReport> {
        let mut b_inner = report(
            "udp",
            ("10.244.0.5", 36552),
            ("10.244.1.5", 9),
            None,
            (
                Some("flannel.1"),
                if dropped { None } else { Some("cali3c4d") },
            ),
            if dropped {
                json!({"kind": "dropped", "hook": "FORWARD", "table": "filter", "reason": "NETFILTER_DROP"})
            } else {
                forwarded()
            },
            None,
        );
        b_inner["stages"] = json!([{"hook": "FORWARD", "table": "filter", "rules": [
            {"text": "-A FORWARD -o cali+ -j cali-to-wl-dispatch"},
            {"text": "-A cali-tw-cali3c4d -p udp -m udp --dport 9 -j DROP"}]}]);
        vec![
            // Noise: another flow of the same pod, and its carrier.
            at(
                "node-a",
                report(
                    "tcp",
                    ("10.244.0.5", 40000),
                    ("10.244.1.5", 8080),
                    None,
                    (Some("cali1a2b"), Some("flannel.1")),
                    forwarded(),
                    None,
                ),
            ),
            at(
                "node-a",
                carrier(
                    "encapsulated",
                    41000,
                    ("10.244.0.5:40000", "10.244.1.5:8080"),
                    "tcp",
                ),
            ),
            at(
                "node-b",
                carrier(
                    "decapsulated",
                    41000,
                    ("10.244.0.5:40000", "10.244.1.5:8080"),
                    "tcp",
                ),
            ),
            at(
                "node-a",
                report(
                    "udp",
                    ("10.244.0.5", 36552),
                    ("10.96.0.30", 9),
                    Some(("10.244.0.5:36552", "10.244.1.5:9")),
                    (Some("cali1a2b"), Some("flannel.1")),
                    forwarded(),
                    None,
                ),
            ),
            // A carrier of the same inner flow but another VNI: not this packet's.
            at("node-b", {
                let mut c = carrier(
                    "decapsulated",
                    57412,
                    ("10.244.0.5:36552", "10.244.1.5:9"),
                    "udp",
                );
                c["encap"]["vni"] = json!(7);
                c
            }),
            at(
                "node-a",
                carrier(
                    "encapsulated",
                    57412,
                    ("10.244.0.5:36552", "10.244.1.5:9"),
                    "udp",
                ),
            ),
            at(
                "node-b",
                carrier(
                    "decapsulated",
                    57412,
                    ("10.244.0.5:36552", "10.244.1.5:9"),
                    "udp",
                ),
            ),
            at("node-b", b_inner),
        ]
    }

    fn wanted_udp9() -> Wanted {
        Wanted {
            src: "10.244.0.5".into(),
            dst: vec!["10.96.0.30".into()],
            port: Some(9),
            proto: Some("udp".into()),
        }
    }

    #[test]
    fn a_packet_dropped_on_the_next_node_is_stitched_through_the_overlay() {
        let j = stitch(&wanted_udp9(), &cluster(true)).expect("found");
        let roles: Vec<(&str, LegRole)> =
            j.legs.iter().map(|l| (l.node.as_str(), l.role)).collect();
        assert_eq!(
            roles,
            [
                ("node-a", LegRole::Source),
                ("node-a", LegRole::Carrier),
                ("node-b", LegRole::Carrier),
                ("node-b", LegRole::Destination)
            ]
        );
        assert!(j.complete, "{:?}", j.missing);
        assert_eq!(
            j.legs[2].report["encap"]["vni"], 1,
            "the carrier of this VNI"
        );
        let end = j.end.as_ref().unwrap();
        assert_eq!(
            (
                end.node.as_str(),
                end.kind.as_str(),
                end.hook.as_deref(),
                end.table.as_deref()
            ),
            ("node-b", "dropped", Some("FORWARD"), Some("filter"))
        );
        assert!(end.rule.as_deref().unwrap().contains("cali-tw-cali3c4d"));
        let text = render(&j);
        assert!(
            text.contains("end: dropped on node-b in FORWARD filter by -A cali-tw-cali3c4d"),
            "{text}"
        );
        assert!(
            text.contains("vxlan encapsulated vni 1 192.168.60.1:57412 -> 192.168.60.2:4789"),
            "{text}"
        );
    }

    #[test]
    fn packets_of_one_flow_are_told_apart_by_their_ip_id_not_their_order() {
        // Two datagrams of the same flow (same tuple, same outer source port); the first
        // VXLAN packet was lost on the underlay: node-b saw only the second.
        let id = |mut r: Value, id: u64, inner: Option<u64>| {
            r["packet"]["ip_id"] = json!(id);
            if let Some(i) = inner {
                r["encap"]["inner_ip_id"] = json!(i);
            }
            r
        };
        let c = cluster(true);
        let (src, sent, got, dest) = (&c[3].report, &c[5].report, &c[6].report, &c[7].report);
        let reports = vec![
            at("node-a", id(src.clone(), 100, None)),
            at("node-a", id(src.clone(), 101, None)),
            at("node-a", id(sent.clone(), 500, Some(100))),
            at("node-a", id(sent.clone(), 501, Some(101))),
            at("node-b", id(got.clone(), 501, Some(101))),
            at("node-b", id(dest.clone(), 101, None)),
        ];
        let j = stitch(&wanted_udp9(), &reports).expect("found");
        assert!(j.complete, "{:?}", j.missing);
        let ids: Vec<Option<u64>> = j.legs.iter().map(|l| ip_id(&l.report)).collect();
        assert_eq!(ids, [Some(101), Some(501), Some(501), Some(101)]);
        assert!(render(&j).contains("10.96.0.30:9 id 101"), "{}", render(&j));
        // Without the identifications, order pairs the first datagram with the second's
        // arrival: what the IDs prevent.
        let strip = |mut r: Value| {
            r["packet"].as_object_mut().unwrap().remove("ip_id");
            if let Some(e) = r.get_mut("encap") {
                e.as_object_mut().unwrap().remove("inner_ip_id");
            }
            r
        };
        let blind: Vec<NodeReport> = reports
            .iter()
            .map(|n| at(&n.node, strip(n.report.clone())))
            .collect();
        let j = stitch(&wanted_udp9(), &blind).expect("found");
        assert!(j.complete);
        assert_eq!(j.legs[1].report, strip(reports[2].report.clone()));
    }

    #[test]
    fn a_missing_arrival_is_said_not_guessed() {
        let mut reports = cluster(false);
        // node-b never reported the carrier of this packet (its agent was down).
        reports.retain(|n| {
            !(n.node == "node-b"
                && n.report["encap"]["outer_src"] == "192.168.60.1:57412"
                && n.report["encap"]["vni"] == 1)
        });
        let j = stitch(&wanted_udp9(), &reports).expect("found");
        assert!(!j.complete);
        assert_eq!(j.legs.len(), 2);
        assert!(
            j.missing.as_deref().unwrap().contains("arriving"),
            "{:?}",
            j.missing
        );
    }

    #[test]
    fn the_first_packet_seen_whole_is_chosen_over_an_earlier_one_seen_in_part() {
        // node-b's observer started after the first datagram: only the second arrives.
        let mut reports = cluster(true);
        let mut early = reports[3..6].to_vec();
        for n in &mut early {
            if let Some(e) = n.report.get_mut("encap") {
                e["outer_src"] = json!("192.168.60.1:50000");
            }
        }
        reports.splice(0..0, early);
        let j = stitch(&wanted_udp9(), &reports).expect("found");
        assert!(j.complete, "{:?}", j.missing);
        assert_eq!(j.legs[1].report["encap"]["outer_src"], "192.168.60.1:57412");
        // Without the second, the first is shown, incomplete.
        reports.truncate(3);
        let j = stitch(&wanted_udp9(), &reports).expect("found");
        assert!(!j.complete);
        assert_eq!(j.legs[1].report["encap"]["outer_src"], "192.168.60.1:50000");
    }

    #[test]
    fn a_routed_packet_is_matched_by_its_tuple_after_nat() {
        let reports = vec![
            at(
                "node-a",
                report(
                    "tcp",
                    ("10.244.0.5", 40000),
                    ("10.96.0.20", 80),
                    Some(("10.244.0.5:40000", "10.244.1.5:80")),
                    (Some("veth1"), Some("eth2")),
                    forwarded(),
                    None,
                ),
            ),
            // The same addresses, another port: not it.
            at(
                "node-b",
                report(
                    "tcp",
                    ("10.244.0.5", 40001),
                    ("10.244.1.5", 80),
                    None,
                    (Some("eth0"), Some("veth9")),
                    forwarded(),
                    None,
                ),
            ),
            at(
                "node-b",
                report(
                    "tcp",
                    ("10.244.0.5", 40000),
                    ("10.244.1.5", 80),
                    None,
                    (Some("eth0"), None),
                    json!({"kind": "delivered", "hook": "INPUT", "table": null}),
                    None,
                ),
            ),
        ];
        let w = Wanted {
            src: "10.244.0.5".into(),
            dst: vec!["10.96.0.20".into()],
            port: None,
            proto: None,
        };
        let j = stitch(&w, &reports).expect("found");
        assert!(j.complete);
        assert_eq!(j.legs.len(), 2);
        assert_eq!(j.legs[1].report["packet"]["sport"], 40000);
        assert_eq!(j.end.unwrap().kind, "delivered");
        let none = Wanted {
            port: Some(443),
            ..w
        };
        assert_eq!(stitch(&none, &reports), None);
    }
}
