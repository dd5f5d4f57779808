//! `nft -j list ruleset`: tables, chains (hook, priority, policy), rules (their `expr` kept
//! verbatim with handles and comments) and named sets and maps. [`compile`] turns this model
//! into the typed [`program`] the simulator walks; [`text`] prints rules the way `nft` does.

pub mod compile;
pub mod program;
pub mod text;
pub mod value;

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::error::ParseError;

/// JSON kept as its text until it is compiled: a rule's `expr`, a set's `elem`. A generic
/// tree of a whole dump takes ~30 times the file's size; the text takes its size, and each
/// rule is read into a tree of its own only while it compiles.
#[derive(Debug, Clone)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    /// The text, exactly as in the dump (already checked to be JSON).
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// The JSON as a tree (for one rule or set at a time).
    pub fn value(&self) -> Value {
        serde_json::from_str(self.0.get()).expect("checked to be JSON when the dump was read")
    }

    /// Parses `text` (tests and tools building a ruleset by hand).
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        RawValue::from_string(text.to_string()).map(Self)
    }

    fn is_array(&self) -> bool {
        self.get().trim_start().starts_with('[')
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct NftRuleset {
    pub tables: Vec<NftTable>,
}

/// Which table: its family and name, and its handle (handles grow with creation, which
/// orders hooks of equal priority).
#[derive(Debug, Clone, PartialEq)]
pub struct TableId {
    pub family: String,
    pub name: String,
    pub handle: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NftTable {
    pub id: TableId,
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
    pub elems: Option<RawJson>,
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
    pub expr: RawJson,
}

const IPTABLES_TABLES: &[&str] = &["raw", "mangle", "nat", "filter", "security"];

impl NftTable {
    /// Tables iptables-nft manages; their rules also appear in `iptables-save`.
    pub fn is_iptables(&self) -> bool {
        matches!(self.id.family.as_str(), "ip" | "ip6")
            && IPTABLES_TABLES.contains(&self.id.name.as_str())
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
            if t.is_iptables() || !(t.id.family == family || t.id.family == "inet") {
                continue;
            }
            for c in &t.chains {
                if c.hook
                    .as_deref()
                    .is_some_and(|h| h.eq_ignore_ascii_case(hook))
                {
                    out.push((format!("{} {}", t.id.family, t.id.name), c));
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

/// One item of the `nftables` array, typed: what the simulator reads is taken, the rest
/// (`metainfo`, `element`, `flowtable`, counters...) skipped without being kept.
#[derive(Deserialize)]
struct Item {
    table: Option<TableJ>,
    chain: Option<ChainJ>,
    rule: Option<RuleJ>,
    set: Option<SetJ>,
    map: Option<SetJ>,
}

#[derive(Deserialize)]
struct TableJ {
    family: String,
    name: String,
    handle: Option<u64>,
}

#[derive(Deserialize)]
struct ChainJ {
    family: String,
    table: String,
    name: String,
    handle: Option<u64>,
    #[serde(rename = "type")]
    kind: Option<String>,
    hook: Option<String>,
    prio: Option<Value>,
    policy: Option<String>,
}

#[derive(Deserialize)]
struct RuleJ {
    family: String,
    table: String,
    chain: String,
    handle: Option<u64>,
    comment: Option<String>,
    expr: Option<Box<RawValue>>,
}

#[derive(Deserialize)]
struct SetJ {
    family: String,
    table: String,
    name: String,
    handle: Option<u64>,
    #[serde(rename = "type")]
    key: Option<Value>,
    map: Option<Value>,
    flags: Option<Value>,
    elem: Option<Box<RawValue>>,
}

/// The hooks nf_tables registers base chains on (every family's).
const HOOKS: &[&str] = &[
    "prerouting",
    "input",
    "forward",
    "output",
    "postrouting",
    "ingress",
    "egress",
];

/// Builds the model one item at a time, as the parser reads them.
#[derive(Default)]
struct Builder {
    rs: NftRuleset,
    // Indices by name: a 5,000-service dump has 15,000 chains, so no linear searches per rule.
    table_ix: HashMap<(String, String), usize>,
    chain_ix: Vec<HashMap<String, usize>>,
    items: usize,
    /// The first error in the model (unknown table, bad policy...), said as is.
    failed: Option<ParseError>,
}

fn item_err(i: usize, what: String) -> ParseError {
    ParseError::new(1, 1, format!("nft JSON, item {}: {what}", i + 1))
}

impl Builder {
    fn table_of(&self, i: usize, kind: &str, fam: &str, tab: &str) -> Result<usize, ParseError> {
        self.table_ix
            .get(&(fam.to_string(), tab.to_string()))
            .copied()
            .ok_or_else(|| item_err(i, format!("{kind} in unknown table {fam} {tab}")))
    }

    fn add(&mut self, i: usize, item: Item) -> Result<(), ParseError> {
        if let Some(t) = item.table {
            self.table_ix
                .insert((t.family.clone(), t.name.clone()), self.rs.tables.len());
            self.chain_ix.push(HashMap::new());
            self.rs.tables.push(NftTable {
                id: TableId {
                    family: t.family,
                    name: t.name,
                    handle: t.handle.unwrap_or(0),
                },
                chains: Vec::new(),
                sets: Vec::new(),
            });
            return Ok(());
        }
        if let Some(c) = item.chain {
            let ti = self.table_of(i, "chain", &c.family, &c.table)?;
            let place = format!("chain {} {} {}", c.family, c.table, c.name);
            if let Some(h) = c.hook.as_deref()
                && !HOOKS.contains(&h)
            {
                return Err(item_err(
                    i,
                    format!(
                        "{place}: `hook` {h:?} is not a netfilter hook ({})",
                        HOOKS.join(", ")
                    ),
                ));
            }
            if let Some(p) = c.policy.as_deref()
                && !matches!(p, "accept" | "drop")
            {
                return Err(item_err(
                    i,
                    format!("{place}: `policy` {p:?} is neither accept nor drop"),
                ));
            }
            if let Some(k) = c.kind.as_deref()
                && !matches!(k, "filter" | "nat" | "route")
            {
                return Err(item_err(
                    i,
                    format!("{place}: `type` {k:?} is not filter, nat or route"),
                ));
            }
            let t = &mut self.rs.tables[ti];
            self.chain_ix[ti]
                .entry(c.name.clone())
                .or_insert(t.chains.len());
            t.chains.push(NftChain {
                name: c.name,
                handle: c.handle.unwrap_or(0),
                kind: c.kind,
                hook: c.hook,
                priority: prio(c.prio.as_ref(), &c.family),
                policy: c.policy,
                rules: Vec::new(),
            });
            return Ok(());
        }
        if let Some(r) = item.rule {
            let ti = self.table_of(i, "rule", &r.family, &r.table)?;
            let (fam, tab, ch) = (&r.family, &r.table, &r.chain);
            let t = &mut self.rs.tables[ti];
            let Some(c) = self.chain_ix[ti].get(ch).map(|&ci| &mut t.chains[ci]) else {
                return Err(item_err(
                    i,
                    format!("rule in unknown chain {fam} {tab} {ch}"),
                ));
            };
            let handle = r.handle.unwrap_or(0);
            let expr = match r.expr.map(RawJson) {
                Some(e) if e.is_array() => e,
                _ => {
                    return Err(item_err(
                        i,
                        format!("rule {fam} {tab} {ch} handle {handle}: `expr` is not a list"),
                    ));
                }
            };
            c.rules.push(NftRule {
                handle,
                comment: r.comment,
                expr,
            });
            return Ok(());
        }
        let (kind, set) = match (item.set, item.map) {
            (Some(s), _) => ("set", s),
            (None, Some(m)) => ("map", m),
            (None, None) => return Ok(()),
        };
        let ti = self.table_of(i, kind, &set.family, &set.table)?;
        let key = strings(set.key.as_ref());
        if key.is_empty() {
            return Err(item_err(
                i,
                format!(
                    "{kind} {} {} {} has no `type`",
                    set.family, set.table, set.name
                ),
            ));
        }
        self.rs.tables[ti].sets.push(NftSet {
            name: set.name,
            handle: set.handle.unwrap_or(0),
            key,
            map: set.map.as_ref().and_then(Value::as_str).map(str::to_string),
            flags: strings(set.flags.as_ref()),
            elems: set.elem.map(RawJson),
        });
        Ok(())
    }
}

/// The `nftables` array, read item by item into the builder (no list of items is kept).
struct Items<'b>(&'b mut Builder);

impl<'de> serde::de::DeserializeSeed<'de> for Items<'_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Items<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("the `nftables` list")
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(item) = seq.next_element::<Item>()? {
            let i = self.0.items;
            self.0.items += 1;
            if let Err(e) = self.0.add(i, item) {
                self.0.failed = Some(e);
                return Err(serde::de::Error::custom("invalid item"));
            }
        }
        Ok(())
    }
}

/// The document: `{"nftables": [...]}`; other keys are skipped.
struct DocSeed<'b>(&'b mut Builder);

impl<'de> serde::de::DeserializeSeed<'de> for DocSeed<'_> {
    type Value = bool;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for DocSeed<'_> {
    type Value = bool;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object {\"nftables\": [...]}")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let mut seen = false;
        while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if k == "nftables" && !seen {
                seen = true;
                map.next_value_seed(Items(&mut *self.0))?;
            } else {
                map.next_value::<serde::de::IgnoredAny>()?;
            }
        }
        Ok(seen)
    }
}

/// Parses `nft -j list ruleset` output straight into the model, item by item (no generic
/// tree of the whole dump, no list of its items). Errors name the item (`item 12, rule ip t
/// c`), or the line and column where the JSON itself is wrong.
pub fn parse_nft_json(text: &str) -> Result<NftRuleset, ParseError> {
    let mut b = Builder::default();
    let mut de = serde_json::Deserializer::from_str(text);
    let seen = serde::de::DeserializeSeed::deserialize(DocSeed(&mut b), &mut de)
        .and_then(|seen| de.end().map(|()| seen));
    match seen {
        Err(_) if b.failed.is_some() => Err(b.failed.take().expect("checked")),
        Err(e) => Err(ParseError::new(
            e.line(),
            e.column(),
            format!("nft JSON: {e}"),
        )),
        Ok(false) => Err(ParseError::new(
            1,
            1,
            "nft JSON: expected {\"nftables\": [...]} (`nft -j list ruleset`)",
        )),
        Ok(true) => Ok(b.rs),
    }
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
