//! `nft -j list ruleset`: tables, chains (hook, priority, policy), rules (their `expr` kept
//! verbatim with handles and comments) and named sets and maps. [`compile`] turns this model
//! into the typed [`program`] the simulator walks; [`text`] prints rules the way `nft` does.

pub mod compile;
pub mod program;
pub mod text;
pub mod value;

use std::collections::HashMap;

use serde_json::Value;

use crate::error::ParseError;

#[derive(Debug, Clone, PartialEq, Default)]
pub struct NftRuleset {
    pub tables: Vec<NftTable>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NftTable {
    pub family: String,
    pub name: String,
    pub handle: u64,
    pub chains: Vec<NftChain>,
    pub sets: Vec<NftSet>,
}

/// A named set or map; its elements stay JSON until compiled against its key type.
#[derive(Debug, Clone, PartialEq)]
pub struct NftSet {
    pub name: String,
    pub handle: u64,
    /// Key type, one entry per concatenated field (`ipv4_addr`, `inet_proto`, `inet_service`...).
    pub key: Vec<String>,
    /// `verdict` for verdict maps, a data type for maps, None for sets.
    pub map: Option<String>,
    pub flags: Vec<String>,
    /// `elem` verbatim; None when the dump lists no elements (an empty set).
    pub elems: Option<Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NftChain {
    pub name: String,
    pub handle: u64,
    pub kind: Option<String>,
    pub hook: Option<String>,
    pub priority: Option<i64>,
    pub policy: Option<String>,
    pub rules: Vec<NftRule>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NftRule {
    pub handle: u64,
    pub comment: Option<String>,
    /// The rule's `expr` array, verbatim.
    pub expr: Value,
}

const IPTABLES_TABLES: &[&str] = &["raw", "mangle", "nat", "filter", "security"];

impl NftTable {
    /// Tables iptables-nft manages; their rules also appear in `iptables-save`.
    pub fn is_iptables(&self) -> bool {
        matches!(self.family.as_str(), "ip" | "ip6")
            && IPTABLES_TABLES.contains(&self.name.as_str())
    }

    pub fn set(&self, name: &str) -> Option<&NftSet> {
        self.sets.iter().find(|s| s.name == name)
    }
}

impl NftRuleset {
    /// Native (non iptables-nft) base chains on `hook` for `family` (`ip`/`ip6`; `inet` covers both).
    pub fn native_base_chains(&self, family: &str, hook: &str) -> Vec<(String, &NftChain)> {
        let mut out = Vec::new();
        for t in &self.tables {
            if t.is_iptables() || !(t.family == family || t.family == "inet") {
                continue;
            }
            for c in &t.chains {
                if c.hook
                    .as_deref()
                    .is_some_and(|h| h.eq_ignore_ascii_case(hook))
                {
                    out.push((format!("{} {}", t.family, t.name), c));
                }
            }
        }
        out
    }
}

fn prio(v: Option<&Value>, family: &str) -> Option<i64> {
    match v? {
        Value::Number(n) => n.as_i64(),
        // The bridge family names its own priorities (nft(8), "PRIORITY").
        Value::String(s) if family == "bridge" => Some(match s.as_str() {
            "dstnat" => -300,
            "filter" => -200,
            "out" => 100,
            "srcnat" => 300,
            _ => return None,
        }),
        // Newer nft prints symbolic priorities, e.g. "filter" or {"base": ...}.
        Value::String(s) => Some(match s.as_str() {
            "raw" => -300,
            "mangle" => -150,
            "dstnat" => -100,
            "filter" => 0,
            "security" => 50,
            "srcnat" => 100,
            _ => return None,
        }),
        _ => None,
    }
}

fn strings(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect(),
        _ => Vec::new(),
    }
}

/// Parses `nft -j list ruleset` output. Errors name the item (`item 12, rule ip t c`).
pub fn parse_nft_json(text: &str) -> Result<NftRuleset, ParseError> {
    let mut v: Value = serde_json::from_str(text)
        .map_err(|e| ParseError::new(e.line(), e.column(), format!("nft JSON: {e}")))?;
    // Owned: rule expressions and set elements are moved out, not copied.
    let items = v
        .get_mut("nftables")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| {
            ParseError::new(
                1,
                1,
                "nft JSON: expected {\"nftables\": [...]} (`nft -j list ruleset`)",
            )
        })?;
    let mut rs = NftRuleset::default();
    // Indices by name: a 5,000-service dump has 15,000 chains, so no linear searches per rule.
    let mut table_ix: HashMap<(String, String), usize> = HashMap::new();
    let mut chain_ix: Vec<HashMap<String, usize>> = Vec::new();
    let s = |o: &Value, k: &str| o.get(k).and_then(Value::as_str).map(str::to_string);
    let h = |o: &Value| o.get("handle").and_then(Value::as_u64).unwrap_or(0);
    let err =
        |i: usize, what: String| ParseError::new(1, 1, format!("nft JSON, item {}: {what}", i + 1));
    for (i, item) in items.iter_mut().enumerate() {
        if let Some(t) = item.get("table") {
            let (family, name) = (
                s(t, "family").unwrap_or_default(),
                s(t, "name").unwrap_or_default(),
            );
            table_ix.insert((family, name), rs.tables.len());
            chain_ix.push(HashMap::new());
            rs.tables.push(NftTable {
                family: s(t, "family").unwrap_or_default(),
                name: s(t, "name").unwrap_or_default(),
                handle: h(t),
                chains: Vec::new(),
                sets: Vec::new(),
            });
            continue;
        }
        let Some(kind) = ["chain", "rule", "set", "map"]
            .into_iter()
            .find(|k| item.get(k).is_some())
        else {
            continue;
        };
        let o = &mut item[kind];
        if !o.is_object() {
            return Err(err(i, format!("{kind} is not an object")));
        }
        let (fam, tab) = (
            s(o, "family").unwrap_or_default(),
            s(o, "table").unwrap_or_default(),
        );
        let Some(&ti) = table_ix.get(&(fam.clone(), tab.clone())) else {
            return Err(err(i, format!("{kind} in unknown table {fam} {tab}")));
        };
        let t = &mut rs.tables[ti];
        match kind {
            "chain" => {
                let name = s(o, "name").unwrap_or_default();
                chain_ix[ti].entry(name.clone()).or_insert(t.chains.len());
                t.chains.push(NftChain {
                    name,
                    handle: h(o),
                    kind: s(o, "type"),
                    hook: s(o, "hook"),
                    priority: prio(o.get("prio"), &t.family),
                    policy: s(o, "policy"),
                    rules: Vec::new(),
                });
            }
            "rule" => {
                let ch = s(o, "chain").unwrap_or_default();
                let Some(c) = chain_ix[ti].get(&ch).map(|&ci| &mut t.chains[ci]) else {
                    return Err(err(i, format!("rule in unknown chain {fam} {tab} {ch}")));
                };
                let expr = o.get_mut("expr").map(Value::take).unwrap_or(Value::Null);
                if !expr.is_array() {
                    return Err(err(
                        i,
                        format!(
                            "rule {fam} {tab} {ch} handle {}: `expr` is not a list",
                            h(o)
                        ),
                    ));
                }
                c.rules.push(NftRule {
                    handle: h(o),
                    comment: s(o, "comment"),
                    expr,
                });
            }
            _ => {
                let name = s(o, "name").unwrap_or_default();
                let key = strings(o.get("type"));
                if key.is_empty() {
                    return Err(err(i, format!("{kind} {fam} {tab} {name} has no `type`")));
                }
                t.sets.push(NftSet {
                    name,
                    handle: h(o),
                    key,
                    map: s(o, "map"),
                    flags: strings(o.get("flags")),
                    elems: o.get_mut("elem").map(Value::take),
                });
            }
        }
    }
    Ok(rs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_chains_rules() {
        let j = r#"{"nftables":[{"metainfo":{"version":"1.0.6","json_schema_version":1}},
          {"table":{"family":"ip","name":"filter","handle":1}},
          {"chain":{"family":"ip","table":"filter","name":"FORWARD","handle":2,"type":"filter","hook":"forward","prio":0,"policy":"drop"}},
          {"table":{"family":"inet","name":"fw","handle":3}},
          {"chain":{"family":"inet","table":"fw","name":"in","handle":1,"type":"filter","hook":"input","prio":"filter","policy":"accept"}},
          {"rule":{"family":"inet","table":"fw","chain":"in","handle":4,"expr":[{"accept":null}],"comment":"hi"}}]}"#;
        let rs = parse_nft_json(j).unwrap();
        assert_eq!(rs.tables.len(), 2);
        assert!(rs.tables[0].is_iptables());
        assert_eq!(rs.tables[0].chains[0].policy.as_deref(), Some("drop"));
        let native = rs.native_base_chains("ip", "input");
        assert_eq!(native.len(), 1);
        assert_eq!(native[0].1.priority, Some(0));
        assert_eq!(native[0].1.rules[0].handle, 4);
        assert!(parse_nft_json("{\"nope\":1}").is_err());
        assert!(parse_nft_json("{").is_err());
    }
}
