//! `observer explain`: the predicted traversal of a packet from the rules alone (no root, no
//! eBPF), through `observer-rules`. Reads files or, with `--live`, the running node.

use std::io::Read;
use std::path::{Path, PathBuf};

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
    #[command(flatten)]
    pub inputs: RuleFiles,
    /// Read rules, sets, routes and bridges from the running node instead of files (needs root).
    #[arg(long, conflicts_with_all = ["ruleset", "ruleset6", "nft", "ipsets", "routes", "bridge_links", "links", "neigh", "fdb", "bridge_nf_call_iptables", "bridge_nf_call_ip6tables", "sysctl"])]
    pub live: bool,
    /// With --live: the `ip netns` name whose rules to read.
    // Checked in `run`: clap's `requires` counts --live's default (false) as given.
    #[arg(long)]
    pub netns: Option<String>,
    /// One JSON object (schema 3, docs/json-schema.md: the live tracer's shape).
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

/// The node's inputs as files: the flag family `explain` and `whatif` share.
#[derive(clap::Args, Debug, Clone)]
pub struct RuleFiles {
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
    /// A sysctl of the node that routing consults, `KEY=VALUE` (repeatable): only
    /// `net.ipv4.conf.<all|IFACE>.route_localnet` is modelled (kube-proxy sets it for
    /// NodePorts on 127.0.0.1). Not given: the kernel's defaults (0) are assumed, and an
    /// explanation they decide says so. `--live` reads the node's own.
    #[arg(long, value_name = "KEY=VALUE")]
    pub sysctl: Vec<String>,
    /// The largest input file read, in MiB: a bigger one (or an endless one such as a
    /// device) is refused before it is parsed. Parsing takes a few times the file's size.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_MAX_INPUT_MIB)]
    pub max_input_mib: u64,
}

impl RuleFiles {
    /// The texts of the files given (each read once, capped); what is not given stays None.
    pub fn texts(&self) -> Result<observer_rules::LiveTexts> {
        let cap = self.max_input_mib;
        let a = self;
        Ok(observer_rules::LiveTexts {
            iptables: read(&a.ruleset, cap)?,
            ip6tables: read(&a.ruleset6, cap)?,
            nft: read(&a.nft, cap)?,
            ipset: read(&a.ipsets, cap)?,
            routes: a
                .routes
                .iter()
                .map(|p| read_capped(p, cap))
                .collect::<Result<_>>()?,
            bridge: Box::new(observer_rules::BridgeTexts {
                bridge_links: read(&a.bridge_links, cap)?,
                links: read(&a.links, cap)?,
                neigh: read(&a.neigh, cap)?,
                fdb: read(&a.fdb, cap)?,
                bridge_nf_call: [a.bridge_nf_call_iptables, a.bridge_nf_call_ip6tables]
                    .map(|v| v.map(|v| v == 1)),
            }),
            sysctls: (!a.sysctl.is_empty()).then(|| a.sysctl.join("\n")),
            ..Default::default()
        })
    }

    /// Whether any of the rules (iptables-save, ip6tables-save, nft) is given.
    pub fn has_rules(&self) -> bool {
        self.ruleset.is_some() || self.ruleset6.is_some() || self.nft.is_some()
    }

    /// Whether any bridge input is given.
    pub fn has_bridge(&self) -> bool {
        self.bridge_links.is_some()
            || self.links.is_some()
            || self.neigh.is_some()
            || self.fdb.is_some()
            || self.bridge_nf_call_iptables.is_some()
            || self.bridge_nf_call_ip6tables.is_some()
    }
}

/// Large enough for a 20,000-service kube-proxy dump, small enough to fail before memory does.
const DEFAULT_MAX_INPUT_MIB: u64 = 256;

/// Reads a text input of at most `cap_mib` MiB. Dumps are text: a NUL byte means the wrong
/// file (or `/dev/zero`), found at once rather than after the cap.
pub fn read_capped(p: &Path, cap_mib: u64) -> Result<String> {
    let cap = cap_mib.saturating_mul(1 << 20);
    let too_big = || {
        anyhow::anyhow!(
            "{} is larger than the {cap_mib} MiB input cap; raise it with --max-input-mib",
            p.display()
        )
    };
    let f = std::fs::File::open(p).with_context(|| format!("reading {}", p.display()))?;
    if f.metadata().is_ok_and(|m| m.is_file() && m.len() > cap) {
        return Err(too_big());
    }
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let mut r = f.take(cap + 1);
    loop {
        let n = r
            .read(&mut chunk)
            .with_context(|| format!("reading {}", p.display()))?;
        if n == 0 {
            break;
        }
        if let Some(i) = chunk[..n].iter().position(|&b| b == 0) {
            bail!(
                "{} holds a NUL byte at offset {}: not a text dump (iptables-save, nft -j, \
                 ipset save, ip -j route output expected)",
                p.display(),
                bytes.len() + i
            );
        }
        bytes.extend_from_slice(&chunk[..n]);
        if bytes.len() as u64 > cap {
            return Err(too_big());
        }
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {}): not a text dump",
            p.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

fn read(p: &Option<PathBuf>, cap_mib: u64) -> Result<Option<String>> {
    p.as_deref().map(|p| read_capped(p, cap_mib)).transpose()
}

pub fn run(a: ExplainArgs) -> Result<String> {
    let mut marks = MarkDictionary::default();
    if a.netns.is_some() && !a.live {
        bail!(
            "--netns names the namespace --live reads; without --live there is nothing to read there"
        );
    }
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
        let texts = a.inputs.texts()?;
        if let Some(text) = &texts.iptables {
            marks.learn_from_iptables_save(text);
        }
        let req = observer_rules::ExplainRequest {
            texts,
            packet: a.packet.clone(),
        };
        observer_rules::explain(&req)?
    };
    if let Some(f) = &a.marks {
        let text = read_capped(f, a.inputs.max_input_mib).context("reading the marks file")?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use std::time::{Duration, Instant};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ExplainArgs,
    }

    fn args(argv: &[&str]) -> Result<ExplainArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("explain").chain(argv.iter().copied())).map(|c| c.a)
    }

    /// A file of its own in the temp directory, removed on drop.
    struct Temp(PathBuf);

    impl Temp {
        fn new(name: &str, bytes: &[u8]) -> Self {
            let p = std::env::temp_dir()
                .join(format!("observer-explain-{}-{name}", std::process::id()));
            std::fs::write(&p, bytes).unwrap();
            Temp(p)
        }
        fn path(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    const PACKET: &str = "tcp 198.51.100.7:40000 -> 10.0.0.2:22 in eth0 out eth1";
    const OPEN: &str =
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";

    #[test]
    fn netns_needs_live() {
        let e = run(args(&["--packet", PACKET, "--ruleset", "x", "--netns", "obs-node"]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("--netns") && e.contains("without --live"), "{e}");
    }

    #[test]
    fn an_endless_or_binary_input_fails_fast() {
        let t = Instant::now();
        let e = run(args(&["--packet", PACKET, "--ruleset", "/dev/zero"]).unwrap()).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert!(format!("{e:#}").contains("NUL byte at offset 0"), "{e:#}");
        // An endless text stream stops at the cap (1 MiB here), never grows past it.
        let yes = std::process::Command::new("sh")
            .args(["-c", "command -v yes"])
            .output()
            .is_ok_and(|o| o.status.success());
        if yes {
            let fifo =
                std::env::temp_dir().join(format!("observer-explain-{}-fifo", std::process::id()));
            let _ = std::fs::remove_file(&fifo);
            assert!(
                std::process::Command::new("mkfifo")
                    .arg(&fifo)
                    .status()
                    .unwrap()
                    .success()
            );
            let mut writer = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("yes '# comment' > {} 2>/dev/null", fifo.display()))
                .spawn()
                .unwrap();
            let r = run(args(&[
                "--packet",
                PACKET,
                "--ruleset",
                fifo.to_str().unwrap(),
                "--max-input-mib",
                "1",
            ])
            .unwrap());
            let _ = writer.kill();
            let _ = writer.wait();
            let _ = std::fs::remove_file(&fifo);
            let e = format!("{:#}", r.unwrap_err());
            assert!(
                e.contains("1 MiB input cap") && e.contains("--max-input-mib"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_file_over_the_cap_is_refused_naming_the_cap_and_the_flag() {
        let mut big = String::from(OPEN);
        while big.len() < (1 << 20) + 10 {
            big.push_str("# padding padding padding padding padding padding padding\n");
        }
        let f = Temp::new("big.rules", big.as_bytes());
        let e = run(args(&[
            "--packet",
            PACKET,
            "--ruleset",
            f.path(),
            "--max-input-mib",
            "1",
        ])
        .unwrap())
        .unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("larger than the 1 MiB input cap; raise it with --max-input-mib"),
            "{e}"
        );
        // Under the default cap it is read.
        let out = run(args(&["--packet", PACKET, "--ruleset", f.path()]).unwrap()).unwrap();
        assert!(out.contains("forwarded out eth1"), "{out}");
    }

    #[test]
    fn a_goto_loop_is_undecidable_through_the_cli() {
        let f = Temp::new(
            "loop.rules",
            b"*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A FORWARD -g A\n-A A -g B\n-A B -g A\nCOMMIT\n",
        );
        let t = Instant::now();
        let out = run(args(&["--packet", PACKET, "--ruleset", f.path()]).unwrap()).unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(out.contains("UNDECIDABLE"), "{out}");
        assert!(
            out.contains("rule walk exceeded 10000 steps (loop?)"),
            "{}",
            &out[out.len().saturating_sub(400)..]
        );
    }

    #[test]
    fn marks_file_errors_are_clear_and_said_once() {
        let rules = Temp::new("m.rules", OPEN.as_bytes());
        let run_with = |marks: &str| {
            let m = Temp::new("m.toml", marks.as_bytes());
            let r = run(args(&[
                "--packet",
                PACKET,
                "--ruleset",
                rules.path(),
                "--marks",
                m.path(),
            ])
            .unwrap());
            r.map_err(|e| format!("{e:#}"))
        };
        let e = run_with("[mraks]\n\"0x1\" = \"x\"\n").unwrap_err();
        assert!(e.contains("unknown key `mraks`"), "{e}");
        let e = run_with("[marks\n").unwrap_err();
        let first = e.lines().next().unwrap_or_default();
        // The TOML parser's message appears once, not again as the error's source.
        let msg = "marks file is not valid TOML";
        assert_eq!(e.matches(msg).count(), 1, "{e}");
        assert!(e.contains("in marks file"), "{first}");
        // Control characters of a rule file do not reach the terminal.
        let evil = Temp::new(
            "evil.rules",
            b"*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n-A FORWARD -m comment --comment \"\x1b[2Jgotcha\" -j ACCEPT\nCOMMIT\n",
        );
        let out = run(args(&["--packet", PACKET, "--ruleset", evil.path()]).unwrap()).unwrap();
        assert!(!out.contains('\x1b'), "{out:?}");
        assert!(out.contains("\\u{1b}[2Jgotcha"), "{out}");
    }
}
