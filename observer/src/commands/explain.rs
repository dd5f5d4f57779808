//! `observer explain`: the predicted traversal of a packet from the rules alone (no root, no
//! eBPF), through `observer-rules`. Reads files or, with `--live`, the running node.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use observer_model::MarkDictionary;
use observer_rules::LiveNode;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  observer explain --ruleset node.rules --ipsets node.ipsets \\\n      --packet \"tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0\" --routes routes.json\n  observer explain --live --netns obs-node --packet \"udp 198.51.100.10:5000 -> 10.10.10.10:53 in eth0\" --json\n\nBridged pods (flannel, the bridge CNI plugin, docker0): a packet `in` a bridge port walks\nbr_netfilter's path (bridge PREROUTING, IP PREROUTING with the bridge as device, then\nbridged to a port or routed) and `-m physdev` is decided, given the ports:\n  bridge -j -d link show > links.json; ip -j neigh show > neigh.json; bridge -j fdb show > fdb.json\n  observer explain --ruleset node.rules --routes routes.json --bridge-links links.json \\\n      --neigh neigh.json --fdb fdb.json --packet \"udp 10.244.0.2:5000 -> 10.96.0.10:53 in veth1\"\n(`out PORT` names the port a bridged frame leaves by; without it the neighbour and fdb\ntables tell, and what they cannot tell stays undecidable.)"
)]
pub struct ExplainArgs {
    /// The packet: "PROTO SRC[:PORT] -> DST[:PORT] in IFACE [out IFACE] [mark 0xN] [state new|established|related|invalid]".
    #[arg(long)]
    pub packet: String,
    /// `iptables-save` output (with or without -c).
    #[arg(long, value_name = "FILE")]
    pub ruleset: Option<PathBuf>,
    /// `ip6tables-save` output, for IPv6 packets.
    #[arg(long, value_name = "FILE")]
    pub ruleset6: Option<PathBuf>,
    /// `nft -j list ruleset` output: native nftables (kube-proxy's nftables mode, Calico's
    /// nftables dataplane) is simulated with the iptables tables, in priority order.
    #[arg(long, value_name = "FILE")]
    pub nft: Option<PathBuf>,
    /// `ipset save` output; sets not given make set matches undecidable.
    #[arg(long, value_name = "FILE")]
    pub ipsets: Option<PathBuf>,
    /// `ip -j route show table all` output (repeat for -6), used when `out` is not given.
    #[arg(long, value_name = "FILE")]
    pub routes: Vec<PathBuf>,
    /// `bridge -j -d link show` output: which interfaces are ports of which bridge, and
    /// their hairpin mode (`-d`). A packet `in` a port then walks br_netfilter's path.
    #[arg(long, value_name = "FILE")]
    pub bridge_links: Option<PathBuf>,
    /// `ip -j [-d] link show` output: bridge ports by their master (with `-d`: only bridge
    /// masters, and the bridges' own `nf_call_iptables`).
    #[arg(long, value_name = "FILE")]
    pub links: Option<PathBuf>,
    /// `ip -j neigh show` output: the MAC of a destination behind a bridge (with --fdb: the
    /// port a bridged frame leaves by).
    #[arg(long, value_name = "FILE")]
    pub neigh: Option<PathBuf>,
    /// `bridge -j fdb show` output: which bridge port learnt a MAC.
    #[arg(long, value_name = "FILE")]
    pub fdb: Option<PathBuf>,
    /// The node's `net.bridge.bridge-nf-call-iptables` (0 or 1; the kernel's default, 1, is
    /// assumed and said when not given): whether bridged IPv4 frames walk the iptables hooks.
    #[arg(long, value_name = "0|1", value_parser = clap::value_parser!(u8).range(0..=1))]
    pub bridge_nf_call_iptables: Option<u8>,
    /// The same for IPv6 (`net.bridge.bridge-nf-call-ip6tables`).
    #[arg(long, value_name = "0|1", value_parser = clap::value_parser!(u8).range(0..=1))]
    pub bridge_nf_call_ip6tables: Option<u8>,
    /// Read rules, sets, routes and bridges from the running node instead of files (needs root).
    #[arg(long, conflicts_with_all = ["ruleset", "ruleset6", "nft", "ipsets", "routes", "bridge_links", "links", "neigh", "fdb", "bridge_nf_call_iptables", "bridge_nf_call_ip6tables"])]
    pub live: bool,
    /// With --live: the `ip netns` name whose rules to read.
    #[arg(long, requires = "live")]
    pub netns: Option<String>,
    /// One JSON object (schema 2, docs/json-schema.md: the live tracer's shape).
    #[arg(long)]
    pub json: bool,
    /// TOML file naming mark bits, as for `observer tail --marks`.
    #[arg(long, value_name = "FILE")]
    pub marks: Option<PathBuf>,
    /// Keep only random outcome N (1-based, as listed): the walk as if every `numgen` or
    /// statistic draw went that way.
    #[arg(long, value_name = "N")]
    pub pick: Option<usize>,
}

fn read(p: &Option<PathBuf>) -> Result<Option<String>> {
    p.as_ref()
        .map(|p| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display())))
        .transpose()
}

pub fn run(a: ExplainArgs) -> Result<String> {
    let mut marks = MarkDictionary::default();
    let explanation = if a.live {
        if let Some(ns) = &a.netns {
            crate::netns::enter(ns)?;
        }
        let live = LiveNode::read();
        if !live.has_rules() && !live.failures.is_empty() {
            let why: Vec<String> = live.failures.iter().map(ToString::to_string).collect();
            bail!("could not read the node's rules: {}", why.join("; "));
        }
        live.learn_marks(&mut marks);
        let packet = observer_rules::parse_packet_spec(&a.packet)?;
        let mut e = observer_rules::explain_with_bridges(
            &live.ruleset,
            &live.ipsets,
            &live.routes,
            &live.bridges,
            &packet,
            &live.iface_addrs,
        );
        // Every read that failed is said: what it leaves out is undecidable, not absent.
        for f in &live.failures {
            e.notes.push(format!("reading the node: {f}"));
        }
        e
    } else {
        let ruleset = read(&a.ruleset)?;
        if let Some(text) = &ruleset {
            marks.learn_from_iptables_save(text);
        }
        let req = observer_rules::ExplainRequest {
            iptables_save: ruleset,
            ip6tables_save: read(&a.ruleset6)?,
            nft_json: read(&a.nft)?,
            ipset_save: read(&a.ipsets)?,
            routes_json: a
                .routes
                .iter()
                .map(|p| {
                    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
                })
                .collect::<Result<_>>()?,
            packet: a.packet.clone(),
            iface_addrs: Default::default(),
            bridge_links_json: read(&a.bridge_links)?,
            links_json: read(&a.links)?,
            neigh_json: read(&a.neigh)?,
            fdb_json: read(&a.fdb)?,
            bridge_nf_call: [a.bridge_nf_call_iptables, a.bridge_nf_call_ip6tables]
                .map(|v| v.map(|v| v == 1)),
        };
        observer_rules::explain(&req)?
    };
    if let Some(f) = &a.marks {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("reading marks file {}", f.display()))?;
        marks
            .apply_toml(&text)
            .with_context(|| format!("in marks file {}", f.display()))?;
    }
    let explanation = match a.pick {
        Some(n) => explanation.pick(n)?,
        None => explanation,
    };
    let t = explanation.to_model(&marks, a.netns.as_deref());
    Ok(if a.json {
        t.to_json_line()
    } else {
        t.render_tree()
    })
}
