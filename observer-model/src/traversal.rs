//! A packet's traversal through netfilter, observed by the probes or predicted from the
//! rules: one type for both, serialized as JSON schema 3 (`docs/json-schema.md`). Values are
//! typed (addresses, ports, protocols, conntrack states, routes); enums serialize to the
//! schema's words; marks are numbers here and hex text in JSON. The text of snapshots and
//! rules is rendered once by the JSON writer and kept beside them (they are shared by many
//! reports), never made by whoever builds the traversal.

use std::sync::{Arc, OnceLock};

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::packet::{CtState, Endpoint, Packet, Protocol};
use crate::vocab::{Family, Hook};

/// The layout version written in every object's `schema` key.
pub const SCHEMA: u32 = 3;

fn hex<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#x}"))
}

fn opt_hex<S: Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => hex(v, s),
        None => s.serialize_none(),
    }
}

/// Whether the kernel was watched (tail) or the rules were asked (explain).
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Observed,
    Predicted,
}

/// The routing decision.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    Input,
    Forward,
    Output,
    /// Forwarded by a bridge from port to port (br_netfilter walked it through the IP hooks),
    /// not routed.
    Bridged,
    /// Predicted only: routing drops the packet.
    Unroutable,
    /// Predicted only: no routes to decide with.
    Unknown,
}

impl Route {
    pub fn name(self) -> &'static str {
        match self {
            Route::Input => "input",
            Route::Forward => "forward",
            Route::Output => "output",
            Route::Bridged => "bridged",
            Route::Unroutable => "unroutable",
            Route::Unknown => "unknown",
        }
    }
}

/// What a table did with the packet.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Accept,
    Drop,
    /// Predicted: a REJECT rule (the kernel drops the packet and answers it).
    Reject,
    /// Observed: taken without a drop (queued).
    Stolen,
    /// Observed: its end was not seen.
    Unknown,
    /// Predicted: a match the simulator cannot decide.
    Undecidable,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Accept => "accept",
            Verdict::Drop => "drop",
            Verdict::Reject => "reject",
            Verdict::Stolen => "stolen",
            Verdict::Unknown => "unknown",
            Verdict::Undecidable => "undecidable",
        }
    }
}

/// How a traversal ended.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FateKind {
    Delivered,
    Forwarded,
    Sent,
    Dropped,
    /// Predicted: a REJECT rule.
    Rejected,
    Consumed,
    Looped,
    Reassembled,
    Incomplete,
    /// Predicted: the simulator could not decide.
    Undecidable,
}

impl FateKind {
    pub fn name(self) -> &'static str {
        match self {
            FateKind::Delivered => "delivered",
            FateKind::Forwarded => "forwarded",
            FateKind::Sent => "sent",
            FateKind::Dropped => "dropped",
            FateKind::Rejected => "rejected",
            FateKind::Consumed => "consumed",
            FateKind::Looped => "looped",
            FateKind::Reassembled => "reassembled",
            FateKind::Incomplete => "incomplete",
            FateKind::Undecidable => "undecidable",
        }
    }
}

#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NatKind {
    Dnat,
    Snat,
}

/// Who translated: the nat chains (first packet of a connection), conntrack's stored
/// translation (every later packet and reply), or IPVS (its own hooks, a stage `ipvs`).
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NatSource {
    Rules,
    Conntrack,
    Ipvs,
}

impl NatSource {
    pub fn name(self) -> &'static str {
        match self {
            NatSource::Rules => "rules",
            NatSource::Conntrack => "conntrack",
            NatSource::Ipvs => "ipvs",
        }
    }
}

/// What IPVS did at its hook (a stage whose table is `ipvs`), named as `ipvsadm -Ln`
/// names it.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct IpvsStep {
    /// The virtual service the packet reached: `TCP  10.96.0.10:53 rr`.
    pub service: String,
    pub scheduler: String,
    /// The real server of this path (`10.244.1.5:53`); None when IPVS sent it nowhere
    /// (no real server with a weight: the packet is dropped with an ICMP error).
    pub real_server: Option<String>,
    /// `Masq`, `Route`, `Tunnel` or `Local`.
    pub forward: Option<String>,
    pub weight: Option<u32>,
    /// Who picked the real server: `scheduler` (a prediction lists every candidate, one
    /// branch each), `connection` (IPVS's connection entry), `persistence`, `only`.
    pub chosen_by: String,
    /// How many real servers the choice was among.
    pub candidates: u32,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Iface {
    pub iface: String,
}

/// One traversal: the packet's path through the hooks and tables of one namespace.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Traversal {
    pub schema: u32,
    pub source: Source,
    /// The observed (or read) namespace: the `--netns` name, `current`, or null for files.
    pub netns: Option<String>,
    pub family: Option<Family>,
    /// Null when no IP header was read.
    pub proto: Option<Protocol>,
    /// Which packet this is: its headers as first seen, and as last seen when NAT changed
    /// them. Null only when no IP header was read.
    pub packet: Option<Packet>,
    pub ingress: Option<Iface>,
    pub egress: Option<Iface>,
    pub route: Option<Route>,
    /// The Linux bridge the packet crossed, with the ports it came in and left by
    /// (br_netfilter's `physdev` in and out). Absent for a packet that met no bridge.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<BridgeCrossing>,
    /// The packet is a VXLAN packet of an overlay (observed only): its outer header, VNI
    /// and the packet it carries. Absent for any other packet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encap: Option<Encapsulation>,
    pub stages: Vec<Stage>,
    pub fate: Fate,
    pub marks: Marks,
    pub nat: Vec<Nat>,
    pub conntrack: Option<Arc<ConntrackView>>,
    /// Kubernetes names of the endpoints shown (`observer agent`: services from kube-proxy's
    /// rules, this node's pods from the API server). Absent when none is known.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<EndpointName>,
    /// Predicted with random choices (`numgen`, `statistic`): every outcome, with its
    /// probability; the top-level stages are the first. Absent otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub branches: Vec<Branch>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Packets the kernel could not record (ring buffer full) since the previous report.
    pub lost: u64,
    /// Part of the traversal is missing: its end was not seen, or the record could not hold
    /// all of it. Never printed as complete.
    pub incomplete: bool,
    pub incomplete_reason: Option<String>,
}

/// A bridge a packet crossed: its device and the ports (the host ends of the pods'
/// veths) it came in by and left by. A port is absent where the packet did not pass one:
/// routed out of another device after entering through a port, or sent by the node.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct BridgeCrossing {
    /// The bridge device (`cni0`, `docker0`).
    pub name: String,
    /// The port it entered through (`--physdev-in`).
    pub physdev_in: Option<String>,
    /// The port it left through (`--physdev-out`); for a frame a FORWARD rule dropped,
    /// the port it was to leave by.
    pub physdev_out: Option<String>,
    /// A copy the bridge made of a frame it flooded to several ports (unknown
    /// destination, broadcast or multicast): first seen at the bridge's FORWARD, so where
    /// it entered belongs to the original frame's report (flagged incomplete, counted).
    pub flooded: bool,
}

/// A VXLAN packet as the probes read it where it was first seen: the outer header (the
/// nodes' underlay addresses, UDP to the VXLAN port), the VXLAN network identifier, and the
/// headers of the packet inside.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Encapsulation {
    /// `vxlan`.
    pub kind: &'static str,
    /// `encapsulated` (the node sent it: its overlay device wrapped a pod's packet),
    /// `decapsulated` (the node received it for its overlay device), or null.
    pub direction: Option<&'static str>,
    pub vni: u32,
    /// The outer header: underlay source and destination (with the UDP ports).
    pub outer_src: Endpoint,
    pub outer_dst: Endpoint,
    /// The packet carried (its tuple as the overlay device saw it).
    pub inner: Quoted,
    /// This namespace's VXLAN device with that VNI and port (`flannel.1`, `vxlan.calico`);
    /// null when none is known (a replay, or the device is gone).
    pub overlay: Option<String>,
    /// The carried packet's IPv4 identification, when recorded (absent: IPv6, or not
    /// asked for; see [`crate::Packet::ip_id`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inner_ip_id: Option<u16>,
}

/// One random outcome of a prediction.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Branch {
    pub probability: f64,
    pub route: Option<Route>,
    pub egress: Option<Iface>,
    pub stages: Vec<Stage>,
    pub fate: Fate,
    pub marks: Marks,
    pub nat: Vec<Nat>,
    pub notes: Vec<String>,
    /// The bridge this outcome crossed; the traversal carries its main outcome's (`bridge`),
    /// so a branch does not print it again.
    #[serde(skip)]
    pub bridge: Option<BridgeCrossing>,
}

/// One table (or nftables base chain) the packet passed.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Stage {
    pub hook: Hook,
    pub table: Arc<str>,
    pub priority: i32,
    /// A native nftables base chain (explain): its family and name; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chain: Option<ChainRef>,
    pub before: Option<Arc<Snapshot>>,
    pub after: Option<Arc<Snapshot>>,
    pub ct: Option<Arc<CtView>>,
    pub verdict: Verdict,
    /// The rules whose counters the kernel increments for this packet here, in order.
    pub rules: Rules,
    /// The built-in chain whose policy decided, when one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// A stage of IPVS's own hook: the virtual service and the real server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipvs: Option<Arc<IpvsStep>>,
    /// Observed stages: whether the rules, simulated on the observed before-state, predict
    /// the observed after-state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<Arc<Check>>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct ChainRef {
    pub family: String,
    pub name: String,
}

/// The packet just before or after a table. Most stages of a packet show the same few, and
/// reports of one flow share them: the JSON writer renders each once and keeps the text
/// here ([`Snapshot::json_cache`]).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub src: Endpoint,
    pub dst: Endpoint,
    pub mark: u32,
    /// `skb->len` (observed only): a GSO/GRO aggregate is one packet of many MTUs; a
    /// reassembled packet grows at defragmentation.
    pub len: Option<u32>,
    /// ICMP errors only: the packet the error quotes, which conntrack translates too.
    pub inner: Option<Quoted>,
    json: OnceLock<Box<str>>,
}

#[derive(Serialize)]
pub(crate) struct SnapshotJson<'a> {
    src: &'a Endpoint,
    dst: &'a Endpoint,
    #[serde(serialize_with = "hex_ref")]
    mark: &'a u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    len: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inner: Option<&'a Quoted>,
}

fn hex_ref<S: Serializer>(v: &&u32, s: S) -> Result<S::Ok, S::Error> {
    hex(v, s)
}

impl Snapshot {
    pub fn new(
        src: Endpoint,
        dst: Endpoint,
        mark: u32,
        len: Option<u32>,
        inner: Option<Quoted>,
    ) -> Self {
        Self {
            src,
            dst,
            mark,
            len,
            inner,
            json: OnceLock::new(),
        }
    }

    pub(crate) fn fields(&self) -> SnapshotJson<'_> {
        SnapshotJson {
            src: &self.src,
            dst: &self.dst,
            mark: &self.mark,
            len: self.len,
            inner: self.inner.as_ref(),
        }
    }

    /// The JSON writer's rendering of this snapshot, made on first use.
    pub(crate) fn json_cache(&self) -> &OnceLock<Box<str>> {
        &self.json
    }
}

impl Serialize for Snapshot {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.fields().serialize(s)
    }
}

impl PartialEq for Snapshot {
    fn eq(&self, o: &Self) -> bool {
        (&self.src, &self.dst, self.mark, self.len, &self.inner)
            == (&o.src, &o.dst, o.mark, o.len, &o.inner)
    }
}

/// The packet an ICMP error quotes.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Quoted {
    pub src: Endpoint,
    pub dst: Endpoint,
    pub proto: Protocol,
}

/// The conntrack entry attached to the packet after a table.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct CtView {
    /// `invalid`: predicted only.
    pub state: CtState,
    /// The ct mark; null when a prediction does not know it.
    #[serde(serialize_with = "opt_hex")]
    pub mark: Option<u32>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Fate {
    pub kind: FateKind,
    /// Where it ended: the hook, and the table only when it died inside that table.
    pub hook: Option<Hook>,
    pub table: Option<Arc<str>>,
    /// The kernel's drop reason, why the traversal is incomplete, or (predicted) the rule
    /// or policy that decided.
    pub reason: Option<String>,
    /// The kernel function that freed it (`ip6_mc_input+0x15e`), for drops and consumed
    /// packets.
    pub location: Option<String>,
    /// The last observation point it passed (`PREROUTING/-99`, `TC ingress`), and the next
    /// one on its path when that is known: it ended between the two.
    pub after: Option<String>,
    pub before: Option<String>,
    /// The rule that dropped it, where the agent's default mode named one for a drop it
    /// saw only where it died (a tier 1 drop sample): simulated on the live ruleset and
    /// held against the rules' counters. Absent everywhere else (a traversal's stages name
    /// their rules).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<DroppingRule>,
}

/// The rule named for a drop seen only where it died, and how sure that is.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct DroppingRule {
    /// `confirmed` (its counter moved by the drop), `unconfirmed` (the simulation names it;
    /// the counters could not confirm it) or `undecidable`.
    pub naming: &'static str,
    pub table: Option<String>,
    pub chain: Option<String>,
    /// As iptables numbers it (`FORWARD#2`) or nft names it (`chain handle 7`).
    pub rule: Option<String>,
    /// Why it is not confirmed.
    pub why: Option<String>,
}

impl Fate {
    pub fn new(kind: FateKind) -> Self {
        Self {
            kind,
            hook: None,
            table: None,
            reason: None,
            location: None,
            after: None,
            before: None,
            rule: None,
        }
    }
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct MarkChange {
    #[serde(serialize_with = "hex")]
    pub bit: u32,
    pub name: Option<Arc<str>>,
    pub hook: Hook,
    pub table: Arc<str>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct Marks {
    pub set: Vec<MarkChange>,
    pub cleared: Vec<MarkChange>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Nat {
    pub kind: NatKind,
    pub hook: Hook,
    pub table: Arc<str>,
    pub from: Endpoint,
    pub to: Endpoint,
    pub source: NatSource,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct TupleView {
    pub src: Endpoint,
    pub dst: Endpoint,
    pub proto: Protocol,
}

/// What Kubernetes calls an endpoint of the traversal.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct EndpointName {
    /// As the stages and conntrack show it: `10.10.10.10:53`, `172.17.0.5`.
    pub endpoint: Endpoint,
    pub kind: NameKind,
    /// `namespace/name:port` for a service, `namespace/name` for a pod.
    pub name: String,
}

/// What Kubernetes object an endpoint is.
#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NameKind {
    /// A ClusterIP port (from kube-proxy's rules).
    Service,
    /// One of this node's pods (from the API server).
    Pod,
}

impl NameKind {
    pub fn name(self) -> &'static str {
        match self {
            NameKind::Service => "service",
            NameKind::Pod => "pod",
        }
    }
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct ConntrackView {
    /// Printed with ` reply` for reply-direction packets (`established reply`).
    #[serde(serialize_with = "ct_state", rename = "state")]
    pub state: (CtState, bool),
    #[serde(serialize_with = "opt_hex")]
    pub mark: Option<u32>,
    pub original: TupleView,
    pub reply: TupleView,
}

impl ConntrackView {
    /// `established`, `established reply`, ...
    pub fn state_text(&self) -> String {
        ct_state_text(self.state)
    }
}

pub(crate) fn ct_state_text((state, reply): (CtState, bool)) -> String {
    if reply {
        format!("{} reply", state.name())
    } else {
        state.name().to_string()
    }
}

fn ct_state<S: Serializer>(v: &(CtState, bool), s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&ct_state_text(*v))
}

/// Which rule: an iptables rule by its chain and 1-based position, or a native nftables
/// rule by its handle.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RuleId {
    Iptables {
        table: String,
        chain: String,
        index: usize,
    },
    Nft {
        family: String,
        table: String,
        chain: String,
        handle: u64,
    },
}

impl RuleId {
    pub fn chain(&self) -> &str {
        match self {
            RuleId::Iptables { chain, .. } | RuleId::Nft { chain, .. } => chain,
        }
    }

    pub fn table(&self) -> &str {
        match self {
            RuleId::Iptables { table, .. } | RuleId::Nft { table, .. } => table,
        }
    }

    /// `CHAIN#INDEX` or `CHAIN handle H`, as the tree prints it.
    pub fn place(&self) -> String {
        match self {
            RuleId::Iptables { chain, index, .. } => format!("{chain}#{index}"),
            RuleId::Nft { chain, handle, .. } => format!("{chain} handle {handle}"),
        }
    }
}

/// The rules of a stage, with their JSON rendered once: a flow's packets name the same
/// rules, and escaping their text again for every report would be most of its cost. No
/// rules (most stages) is no allocation and nothing to count references of.
#[derive(Debug, Clone, Default)]
pub struct Rules(Option<Arc<RuleList>>);

#[derive(Debug)]
struct RuleList {
    items: Vec<Rule>,
    /// Their JSON, rendered on first use.
    json: OnceLock<Box<str>>,
}

impl Rules {
    /// Their JSON, as it is printed (rendered once, then kept with them).
    pub fn json(&self) -> &str {
        self.0.as_ref().map_or("[]", |r| {
            r.json.get_or_init(|| {
                serde_json::to_string(&r.items)
                    .expect("rules serialise")
                    .into_boxed_str()
            })
        })
    }

    pub fn new(items: Vec<Rule>) -> Self {
        if items.is_empty() {
            return Self(None);
        }
        Self(Some(Arc::new(RuleList {
            items,
            json: OnceLock::new(),
        })))
    }
}

impl FromIterator<Rule> for Rules {
    fn from_iter<I: IntoIterator<Item = Rule>>(iter: I) -> Self {
        Self::new(iter.into_iter().collect())
    }
}

impl std::ops::Deref for Rules {
    type Target = [Rule];
    fn deref(&self) -> &[Rule] {
        self.0.as_ref().map_or(&[], |r| &r.items)
    }
}

impl PartialEq for Rules {
    fn eq(&self, o: &Self) -> bool {
        **self == **o
    }
}

impl Serialize for Rules {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Some(r) => r.items.serialize(s),
            None => s.collect_seq(std::iter::empty::<Rule>()),
        }
    }
}

/// A rule whose counters the kernel increments for this packet.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub id: RuleId,
    pub text: String,
    /// What it did: `jump KUBE-SVC-...`, `accept`, `mark 0x0 -> 0x4000`, `DNAT 172.17.0.5:22`.
    pub action: String,
    /// Packet mark before and after, for rules that set it.
    pub mark: Option<(u32, u32)>,
    /// Set when the rule could not be decided; the walk stopped there.
    pub undecidable: Option<String>,
    /// For an iptables rule loaded through iptables-nft: its nf_tables family and handle.
    pub iptables_nft: Option<(String, u64)>,
    /// The Kubernetes service (and endpoint) a kube-proxy rule is for.
    pub k8s: Option<K8s>,
    /// Calico's rule id (from its `cali:` comment).
    pub calico: Option<String>,
}

#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct K8s {
    pub service: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
}

impl Serialize for Rule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        if let RuleId::Nft { family, .. } = &self.id {
            m.serialize_entry("family", family)?;
        }
        m.serialize_entry("table", self.id.table())?;
        m.serialize_entry("chain", self.id.chain())?;
        match &self.id {
            RuleId::Iptables { index, .. } => m.serialize_entry("index", index)?,
            RuleId::Nft { handle, .. } => m.serialize_entry("handle", handle)?,
        }
        m.serialize_entry("text", &self.text)?;
        m.serialize_entry("action", &self.action)?;
        if let Some((before, after)) = self.mark {
            m.serialize_entry(
                "mark",
                &serde_json::json!({ "before": format!("{before:#x}"), "after": format!("{after:#x}") }),
            )?;
        }
        if let Some(u) = &self.undecidable {
            m.serialize_entry("undecidable", u)?;
        }
        if let Some((family, handle)) = &self.iptables_nft {
            m.serialize_entry(
                "iptables_nft",
                &serde_json::json!({ "family": family, "handle": handle }),
            )?;
        }
        if let Some(k) = &self.k8s {
            m.serialize_entry("k8s", k)?;
        }
        if let Some(id) = &self.calico {
            m.serialize_entry("calico", &serde_json::json!({ "rule_id": id }))?;
        }
        m.end()
    }
}

/// The rules' prediction for an observed stage, held against what the kernel did.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub result: CheckResult,
    /// Each difference, with both sides: "rules predict mark 0x4000, the kernel set 0x0".
    pub disagreements: Vec<String>,
    /// Why the rules cannot tell (an undecidable match), when `result` is `undecidable`.
    pub reason: Option<String>,
}

#[derive(Serialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CheckResult {
    Agrees,
    Disagrees,
    Undecidable,
}
