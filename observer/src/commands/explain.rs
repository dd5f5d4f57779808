//! `observer explain`: the predicted traversal of a packet from the rules alone (no root, no
//! eBPF), through `observer-rules`. Reads files or, with `--live`, the running node.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use observer_model::MarkDictionary;
use observer_rules::LiveNode;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  observer explain --ruleset node.rules --ipsets node.ipsets \\\n      --packet \"tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0\" --routes routes.json\n  observer explain --live --netns obs-node --packet \"udp 198.51.100.10:5000 -> 10.10.10.10:53 in eth0\" --json"
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
    /// Read rules, sets and routes from the running node instead of files (needs root).
    #[arg(long, conflicts_with_all = ["ruleset", "ruleset6", "nft", "ipsets", "routes"])]
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
            crate::kernel::netns::enter(ns)?;
        }
        let live = LiveNode::read();
        if !live.has_rules() && !live.failures.is_empty() {
            let why: Vec<String> = live.failures.iter().map(ToString::to_string).collect();
            bail!("could not read the node's rules: {}", why.join("; "));
        }
        live.learn_marks(&mut marks);
        let packet = observer_rules::parse_packet_spec(&a.packet)?;
        let mut e = observer_rules::explain_with(
            &live.ruleset,
            &live.ipsets,
            &live.routes,
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
