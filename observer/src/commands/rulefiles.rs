//! The node's inputs given as files (`iptables-save`, `nft -j`, `ipset save`, `ip -j route`,
//! the bridge's), or read from the running node (`--live`): the flag families `explain` and
//! `whatif` share, and the one place such a file, or the live node, is read.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use observer_model::MarkDictionary;
use observer_rules::LiveNode;

/// `--live [--netns NAME]`: the running node instead of files.
#[derive(clap::Args, Debug, Clone)]
pub struct LiveArgs {
    /// Read rules, sets, routes, addresses and bridges from the running node instead of
    /// files (needs root): `explain` walks its packet there, `whatif` takes it as the new
    /// side (edit the node, then ask).
    #[arg(long, conflicts_with_all = ["ruleset", "ruleset6", "nft", "ipsets", "routes", "bridge_links", "links", "neigh", "fdb", "bridge_nf_call_iptables", "bridge_nf_call_ip6tables", "ipvs", "ipvs_conntrack", "sysctl"])]
    pub live: bool,
    /// With --live: the `ip netns` name whose node to read.
    // Checked in `read`: clap's `requires` counts --live's default (false) as given.
    #[arg(long, value_name = "NAME")]
    pub netns: Option<String>,
}

impl LiveArgs {
    /// The running node (the namespace `--netns`, else this one) when `--live` is given;
    /// an error when none of its rules could be read, or `--netns` comes without `--live`.
    pub fn read(&self) -> Result<Option<LiveNode>> {
        if !self.live {
            if self.netns.is_some() {
                bail!(
                    "--netns names the namespace --live reads; without --live there is nothing to read there"
                );
            }
            return Ok(None);
        }
        if let Some(ns) = &self.netns {
            crate::kernel::netns::enter(ns)?;
        }
        let live = LiveNode::read();
        if !live.has_rules() && !live.failures.is_empty() {
            let why: Vec<String> = live.failures.iter().map(ToString::to_string).collect();
            bail!("could not read the node's rules: {}", why.join("; "));
        }
        Ok(Some(live))
    }
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
    /// `ipvsadm -Sn` output: IPVS's virtual services and real servers (kube-proxy's IPVS
    /// mode). A packet routed to this host, or sent by it, that reaches a virtual service is
    /// scheduled at IPVS's hook; several real servers are each listed (`branches`).
    #[arg(long, value_name = "FILE")]
    pub ipvs: Option<PathBuf>,
    /// The node's `net.ipv4.vs.conntrack` (0 or 1; kube-proxy's 1 is assumed and said when
    /// not given): whether IPVS's connections keep their conntrack entries.
    #[arg(long, value_name = "0|1", value_parser = clap::value_parser!(u8).range(0..=1))]
    pub ipvs_conntrack: Option<u8>,
    /// The largest input file read, in MiB: a bigger one (or an endless one such as a
    /// device) is refused before it is parsed. Parsing takes a few times the file's size.
    #[arg(long, value_name = "MIB", default_value_t = DEFAULT_MAX_INPUT_MIB)]
    pub max_input_mib: u64,
}

impl RuleFiles {
    /// The texts of the files given (each read once, capped); what is not given stays None.
    pub fn texts(&self) -> Result<observer_rules::LiveTexts> {
        let a = self;
        Ok(observer_rules::LiveTexts {
            iptables: a.read(a.ruleset.as_deref())?,
            ip6tables: a.read(a.ruleset6.as_deref())?,
            nft: a.read(a.nft.as_deref())?,
            ipset: a.read(a.ipsets.as_deref())?,
            routes: a
                .routes
                .iter()
                .map(|p| read_capped(p, a.max_input_mib))
                .collect::<Result<_>>()?,
            bridge: Box::new(observer_rules::BridgeTexts {
                bridge_links: a.read(a.bridge_links.as_deref())?,
                links: a.read(a.links.as_deref())?,
                neigh: a.read(a.neigh.as_deref())?,
                fdb: a.read(a.fdb.as_deref())?,
                bridge_nf_call: [a.bridge_nf_call_iptables, a.bridge_nf_call_ip6tables]
                    .map(|v| v.map(|v| v == 1)),
            }),
            ipvs: a.read(a.ipvs.as_deref())?,
            ipvs_conntrack: a.ipvs_conntrack.map(|v| v == 1),
            sysctls: (!a.sysctl.is_empty()).then(|| a.sysctl.join("\n")),
            ..Default::default()
        })
    }

    /// Another input of the same command (`whatif --old`, ...), read as these are: capped
    /// by `--max-input-mib`, refused when it is not text.
    pub fn read(&self, p: Option<&Path>) -> Result<Option<String>> {
        p.map(|p| read_capped(p, self.max_input_mib)).transpose()
    }

    /// Names the mark bits `file` (TOML, as `tail --marks` takes) names in `marks`.
    pub fn apply_marks_file(&self, marks: &mut MarkDictionary, file: &Path) -> Result<()> {
        let text = read_capped(file, self.max_input_mib).context("reading the marks file")?;
        marks
            .apply_toml(&text)
            .with_context(|| format!("in marks file {}", file.display()))
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

/// A file of its own in the temp directory, removed on drop: the inputs of the commands'
/// tests.
#[cfg(test)]
pub(crate) struct Temp(PathBuf);

#[cfg(test)]
impl Temp {
    pub fn new(name: &str, bytes: impl AsRef<[u8]>) -> Self {
        let p = std::env::temp_dir().join(format!("observer-test-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        Temp(p)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

#[cfg(test)]
impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
