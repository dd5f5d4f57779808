//! A capture window's traversals as whatif's flows: the schema-3 JSON lines an agent
//! streamed (`tail --agent --record`, `drops --agent --record`, `kubectl observer record`)
//! read into the same [`FlowKey`] a `tail --record` recording gives. What a line does not
//! hold (a drop sample of the agent's default mode is seen only where it died: its mark and
//! connection as it entered are unknown) makes the flow undecidable, never unchanged.

use std::net::IpAddr;

use observer_model::{CtState, Protocol};
use observer_rules::StoredNat;
use serde_json::Value;

use super::{FlowKey, Unusable};

/// A protocol by the name reports print (`tcp`), or its number.
fn protocol(v: &Value) -> Option<u8> {
    if let Some(n) = v.as_u64() {
        return u8::try_from(n).ok();
    }
    let s = v.as_str()?;
    if let Ok(n) = s.parse::<u8>() {
        return Some(n);
    }
    (0..=255u8).find(|&n| Protocol::from_number(n).name() == s)
}

fn ct_state(s: &str) -> Option<CtState> {
    Some(match s {
        "new" => CtState::New,
        "established" => CtState::Established,
        "related" => CtState::Related,
        "invalid" => CtState::Invalid,
        "untracked" => CtState::Untracked,
        _ => return None,
    })
}

/// `0x4000` (marks are hex text in JSON).
fn hex(v: &Value) -> Option<u32> {
    let s = v.as_str()?;
    u32::from_str_radix(s.strip_prefix("0x")?, 16).ok()
}

/// `a.b.c.d:port`, `[v6]:port`, or an address alone.
pub fn endpoint(s: &str) -> Option<(IpAddr, Option<u16>)> {
    if let Ok(a) = s.parse::<IpAddr>() {
        return Some((a, None));
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (a, port) = rest.split_once("]:")?;
        return Some((a.parse().ok()?, Some(port.parse().ok()?)));
    }
    let (a, port) = s.rsplit_once(':')?;
    Some((a.parse().ok()?, Some(port.parse().ok()?)))
}

/// The route names a report carries, as [`observer_model::Route::name`] has them.
fn route(s: &str) -> Option<&'static str> {
    [
        "input",
        "forward",
        "output",
        "bridged",
        "unroutable",
        "unknown",
    ]
    .into_iter()
    .find(|r| *r == s)
}

/// The translation conntrack applied (the report's `nat` entries of source `conntrack`).
fn stored_nat(v: &Value) -> StoredNat {
    let mut s = StoredNat::default();
    for n in v["nat"].as_array().into_iter().flatten() {
        if n["source"] != "conntrack" {
            continue;
        }
        let Some(to) = n["to"].as_str().and_then(endpoint) else {
            continue;
        };
        match (n["kind"].as_str(), n["hook"].as_str()) {
            (Some("dnat"), Some("PREROUTING" | "OUTPUT")) => s.dst = s.dst.or(Some(to)),
            (Some("snat"), Some("POSTROUTING" | "INPUT")) => s.src = s.src.or(Some(to)),
            _ => {}
        }
    }
    s
}

/// Why an incomplete report cannot stand for its flow, if it cannot.
fn undecidable(v: &Value) -> Option<&'static str> {
    if v["incomplete"] != true {
        return None;
    }
    let no_stages = v["stages"].as_array().is_none_or(Vec::is_empty);
    let reason = v["incomplete_reason"].as_str().unwrap_or("");
    if no_stages {
        Some(
            "seen only where it died (a drop sample of the agent's default mode): its mark and \
             connection as it entered are not known; arm the agent (`POST /v1/arm`) or stream \
             its traversals to have them whole",
        )
    } else if reason.contains("first seen after its start") {
        Some("first seen after its start: the packet as it entered is not known")
    } else {
        None
    }
}

/// A report's packet in `explain --packet` words, as far as the report says (for flows
/// that cannot be decided).
pub fn describe(v: &Value) -> String {
    let p = &v["packet"];
    let ep = |a: &Value, port: &Value| {
        let a = a.as_str().unwrap_or("?");
        match port.as_u64() {
            Some(n) if a.contains(':') => format!("[{a}]:{n}"),
            Some(n) => format!("{a}:{n}"),
            None => a.to_string(),
        }
    };
    let proto = match &p["proto"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out = format!(
        "{proto} {} -> {}",
        ep(&p["src"], &p["sport"]),
        ep(&p["dst"], &p["dport"])
    );
    if let Some(i) = v["ingress"]["iface"].as_str() {
        out.push_str(" in ");
        out.push_str(i);
    }
    if let Some(k) = v["fate"]["kind"].as_str() {
        out.push_str(" (");
        out.push_str(k);
        out.push(')');
    }
    out
}

impl FlowKey {
    /// The flow of a report as JSON (schema 3, `tail --json` and the agent's streams),
    /// recorded under ruleset `ruleset`: the same key [`FlowKey::of`] makes of the
    /// traversal the report was made of.
    pub fn of_json(v: &Value, ruleset: usize) -> Result<FlowKey, Unusable> {
        let p = &v["packet"];
        if p.is_null() {
            return Err(Unusable::NoHeader);
        }
        if let Some(why) = undecidable(v) {
            return Err(Unusable::Undecidable(why));
        }
        let addr = |k: &str| p[k].as_str().and_then(|s| s.parse::<IpAddr>().ok());
        let (Some(src), Some(dst), Some(proto)) = (addr("src"), addr("dst"), protocol(&p["proto"]))
        else {
            return Err(Unusable::NoHeader);
        };
        let port = |k: &str| p[k].as_u64().and_then(|n| u16::try_from(n).ok());
        let icmp = p["icmp"].as_object().and_then(|i| {
            let t = u8::try_from(i.get("type")?.as_u64()?).ok()?;
            let c = u8::try_from(i.get("code")?.as_u64()?).ok()?;
            Some((t, c))
        });
        let iface = |k: &str| v[k]["iface"].as_str().map(str::to_string);
        let stages = v["stages"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        let ct = stages.iter().map(|s| &s["ct"]).find(|c| c.is_object());
        let state = match ct {
            None => CtState::New,
            Some(c) => match c["state"].as_str().and_then(ct_state) {
                None | Some(CtState::Untracked) => CtState::New,
                Some(s) => s,
            },
        };
        let route = match v["route"].as_str() {
            None => None,
            Some(r) => {
                Some(route(r).ok_or(Unusable::Undecidable("a route this observer does not know"))?)
            }
        };
        Ok(FlowKey {
            proto,
            src,
            sport: port("sport"),
            dst,
            dport: port("dport"),
            icmp,
            ingress: iface("ingress"),
            egress: iface("egress"),
            route,
            mark: stages
                .first()
                .and_then(|s| hex(&s["before"]["mark"]))
                .unwrap_or(0),
            state,
            reply: v["conntrack"]["state"]
                .as_str()
                .is_some_and(|s| s.ends_with(" reply")),
            ct_mark: if state == CtState::New {
                None
            } else {
                ct.and_then(|c| hex(&c["mark"]))
            },
            stored: if state == CtState::New {
                StoredNat::default()
            } else {
                stored_nat(v)
            },
            ruleset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_as_reports_write_them() {
        assert_eq!(
            endpoint("10.0.0.1:80"),
            Some(("10.0.0.1".parse().unwrap(), Some(80)))
        );
        assert_eq!(
            endpoint("[2001:db8::1]:53"),
            Some(("2001:db8::1".parse().unwrap(), Some(53)))
        );
        assert_eq!(
            endpoint("2001:db8::1"),
            Some(("2001:db8::1".parse().unwrap(), None))
        );
        assert_eq!(endpoint("<address of eth0>:80"), None);
        assert_eq!(protocol(&Value::from("udp")), Some(17));
        assert_eq!(protocol(&Value::from("132")), Some(132));
    }

    /// Every traversal of the golden lab recording, as its JSON report (what an agent
    /// streams), makes the same flow as the traversal itself: a window and a recording of
    /// the same traffic fold alike.
    #[test]
    fn a_report_makes_the_flow_its_traversal_makes() {
        use crate::pipeline::{Handled, Outcome, Sink};
        struct Both(Vec<(FlowKey, Value)>, u64);
        impl Sink for Both {
            fn handled(&mut self, h: &Handled<'_>) -> std::io::Result<()> {
                if let Outcome::Report { report, .. } = h.outcome {
                    let t = report.traversal();
                    let v: Value = serde_json::from_str(&t.to_json_line()).unwrap();
                    match FlowKey::of(t, 0) {
                        Ok(k) => self.0.push((k, v)),
                        Err(_) => self.1 += 1,
                    }
                }
                Ok(())
            }
        }
        let file = format!(
            "{}/../observer/tests/golden/lab-flows.obsrec",
            env!("CARGO_MANIFEST_DIR")
        );
        let opts = crate::commands::replay::ReplayOptions {
            file: file.into(),
            output: crate::pipeline::Output::Line,
            count: None,
            filter: None,
        };
        let mut both = Both(Vec::new(), 0);
        crate::commands::replay::each(&opts, &mut both).unwrap();
        assert!(both.0.len() > 10, "{}", both.0.len());
        let (mut same, mut undecided) = (0, 0);
        for (k, v) in &both.0 {
            match FlowKey::of_json(v, 0) {
                Ok(j) => {
                    assert_eq!(&j, k, "{v}");
                    same += 1;
                }
                // Only what the report itself says is not whole.
                Err(Unusable::Undecidable(_)) => {
                    assert_eq!(v["incomplete"], true, "{v}");
                    undecided += 1;
                }
                Err(e) => panic!("{e:?}: {v}"),
            }
        }
        assert!(same > undecided, "{same} {undecided}");
    }

    /// A drop sample of the agent's default mode (no stages): undecidable, never a flow
    /// with a guessed mark.
    #[test]
    fn a_drop_sample_seen_only_where_it_died_is_undecidable() {
        let v: Value = serde_json::json!({
            "schema": 3, "source": "observed",
            "packet": {"family": "ipv4", "proto": "udp", "src": "10.0.0.1", "dst": "10.0.0.2",
                       "sport": 1000, "dport": 9, "icmp": null, "last": null},
            "ingress": {"iface": "eth0"}, "stages": [],
            "fate": {"kind": "dropped"}, "incomplete": true,
            "incomplete_reason": "seen only where it was dropped"
        });
        assert!(matches!(
            FlowKey::of_json(&v, 0),
            Err(Unusable::Undecidable(w)) if w.contains("seen only where it died")
        ));
        let mut whole = v.clone();
        whole["incomplete"] = false.into();
        let k = FlowKey::of_json(&whole, 0).unwrap();
        assert_eq!((k.proto, k.dport, k.state), (17, Some(9), CtState::New));
    }
}
