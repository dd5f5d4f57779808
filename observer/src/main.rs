//! observer: the real path of every packet through Linux netfilter, seen by eBPF probes.

use observer::{explain, lab, replay, tail, traffic};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "observer",
    version,
    about = "Shows which netfilter table touched each packet, what it changed, and where it died",
    long_about = "observer attaches eBPF probes to the netfilter hooks (between every table: \
raw, conntrack, mangle, nat, filter, security) and to TC ingress/egress of every interface in a \
network namespace, then prints one report per packet traversal: for each hook and table, the \
packet's addresses and mark before and after, its conntrack state, and whether it went on.\n\n\
Only the first packet of a connection walks the nat table; later packets get conntrack's stored \
translation at the same place, which the reports show as well.\n\n\
Needs root, Linux 6.4+ with BTF (/sys/kernel/btf/vmlinux) and BPF netfilter links.\n\n\
Memory is bounded: the probes' ring buffer (16 MiB) and maps (per-CPU slots and a 4,096-entry \
fallback map) are fixed in size, the collector keeps no per-packet state and drains in batches; \
a packet that finds no room is counted as lost, never dropped silently.\n\n\
Try it:  observer lab up && observer tail --netns obs-node   (and `observer lab traffic` in \
another terminal)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Stream one report per packet traversal (human tree, or JSON lines with --json).
    Tail(TailArgs),
    /// Print the reports of a `tail --record` file again: same output, no root, no eBPF,
    /// on any machine.
    Replay(ReplayArgs),
    /// Predict a packet's path from the rules alone: every rule that matches, mark and NAT
    /// changes, the verdict (no root, no eBPF; or --live on a node).
    Explain(explain::ExplainArgs),
    /// Build, inspect or remove the built-in netns lab (a Kubernetes-like node).
    Lab {
        #[command(subcommand)]
        action: LabAction,
        /// Prefix of the lab's namespace names (<prefix>-client, <prefix>-node, ...).
        #[arg(long, default_value = "obs", global = true)]
        prefix: String,
        /// With `up`: kube-proxy's mode on the node (nftables: native `kube-proxy` tables,
        /// no KUBE-* iptables rules).
        #[arg(long, value_enum, default_value = "iptables", global = true)]
        mode: lab::Mode,
    },
}

#[derive(clap::Args)]
struct TailArgs {
    /// `ip netns` name to observe (default: the current namespace).
    #[arg(long)]
    netns: Option<String>,
    /// How to print each traversal.
    #[arg(long, value_enum, default_value = "tree")]
    output: tail::Output,
    /// Same as --output json: one JSON object per line (schema 2, see docs/json-schema.md).
    #[arg(long, conflicts_with = "output")]
    json: bool,
    /// Trace only packets matching this pcap-filter subset, evaluated in the kernel
    /// (e.g. "tcp and port 22", "host 10.10.10.2", "iface cali1a2b", "mark 0x4000/0x4000").
    /// A packet matches by its current addresses or its connection's original or reply
    /// tuple, so a ClusterIP filter follows the packet after DNAT. See docs/filter.md.
    #[arg(long, value_name = "EXPR")]
    filter: Option<String>,
    /// Keep one flow in N (a connection's packets are kept or left out together).
    #[arg(long, value_name = "N", default_value_t = 1)]
    sample: u32,
    /// TOML file naming mark bits, applied over the defaults and the live ruleset:
    /// `calico_mark_mask = "0xffff0000"` (Felix's iptablesMarkMask: accept, pass, two
    /// scratch bits, then the endpoint block), and a `[marks]` table of lines like
    /// `"0x4000" = "kube-proxy:masquerade"` (an empty name forgets a bit).
    #[arg(long, value_name = "FILE")]
    marks: Option<PathBuf>,
    /// Exit after printing N traversals (0: attach, then exit at once).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Write this file once every probe is attached (for scripts and tests).
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,
    /// Exit after SECS seconds (a decimal number, up to a year).
    #[arg(long, value_name = "SECS", value_parser = parse_seconds)]
    timeout: Option<Duration>,
    /// A packet the probes have followed for this long without seeing its end (it waits in
    /// a queue, or was freed unseen) is printed as incomplete.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    idle_ms: u64,
    /// Write the summary (packets seen, printed, lost, incomplete, filtered, sampled, in
    /// flight) to FILE as one JSON object at exit (docs/json-schema.md).
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// Benchmarks only: attach every probe but let each return at once (the hooks' own cost).
    #[arg(long, hide = true)]
    floor: bool,
    /// Do not name the rules of each stage (by default each observed stage lists the rules
    /// that matched, simulated from the live ruleset, and says whether they agree with
    /// what the kernel did).
    #[arg(long)]
    no_rules: bool,
    /// Also save every traversal record, with the probe plan, kernel layout, interface
    /// names, kernel symbols and mark names its report needs, to FILE; `observer replay
    /// FILE` prints the same reports later, anywhere, without root (docs/recording.md).
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Also write each printed traversal's packet to FILE as pcap-ng, for Wireshark or
    /// tshark: its first 128 bytes from the IP header (LINKTYPE_RAW), taken where the
    /// traversal started, on an interface block per interface it entered on, with the
    /// traversal's one-line report as the packet comment (`tshark -r FILE -V`, or the
    /// `frame.comment` field). Without it the probes only check a flag.
    #[arg(long, value_name = "FILE")]
    pcapng: Option<PathBuf>,
}

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    observer tail --netns obs-node --record node.obsrec   # as root, on the node\n  \
    observer replay node.obsrec                          # anywhere, no root\n  \
    observer replay --json node.obsrec | jq -c .fate\n\n\
The file holds the raw records with the probe plan, kernel layout, interface names, kernel \
symbols and mark names they need (docs/recording.md); a recording of another format or record \
layout is refused with the version that can read it.")]
struct ReplayArgs {
    /// A file written by `observer tail --record FILE`.
    file: PathBuf,
    /// How to print each traversal (the recording holds records, not a format: any works).
    #[arg(long, value_enum, default_value = "tree")]
    output: tail::Output,
    /// Same as --output json: one JSON object per line (schema 2, see docs/json-schema.md).
    #[arg(long, conflicts_with = "output")]
    json: bool,
    /// Stop after printing N traversals.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Print only the traversals this pcap-filter subset keeps (docs/filter.md), decided
    /// from the record as the probes decide after conntrack: by the packet as it entered
    /// and its connection's tuples; interface names are the recording's.
    #[arg(long, value_name = "EXPR")]
    filter: Option<String>,
}

/// `--timeout`: a finite, non-negative number of seconds, at most a year.
fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !secs.is_finite() || !(0.0..=365.0 * 86400.0).contains(&secs) {
        return Err(format!("`{s}` is out of range: give 0 to 31536000 seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[derive(Subcommand)]
enum LabAction {
    /// Create the namespaces, links, addresses and the node's iptables rules and ipsets.
    Up,
    /// Remove every namespace of the lab.
    Down,
    /// Show which of the lab's namespaces exist.
    Status,
    /// Send the demo flows through the lab (client -> ClusterIP, pod -> external, client -> node).
    Traffic,
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("observer: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tail(a) => {
            let summary = tail::run(tail::TailOptions {
                netns: a.netns,
                output: if a.json { tail::Output::Json } else { a.output },
                marks_file: a.marks,
                filter: a.filter,
                sample: a.sample,
                count: a.count,
                ready_file: a.ready_file,
                timeout: a.timeout,
                idle: Duration::from_millis(a.idle_ms),
                stats_file: a.stats,
                floor: a.floor,
                rules: !a.no_rules,
                record: a.record,
                pcapng: a.pcapng,
            })?;
            eprintln!("{summary}");
            Ok(())
        }
        Command::Replay(a) => {
            let summary = replay::run(
                &replay::ReplayOptions {
                    file: a.file,
                    output: if a.json { tail::Output::Json } else { a.output },
                    count: a.count,
                    filter: a.filter,
                },
                &mut std::io::stdout().lock(),
            )?;
            eprintln!("{summary}");
            Ok(())
        }
        Command::Explain(a) => {
            println!("{}", explain::run(a)?);
            Ok(())
        }
        Command::Lab {
            action,
            prefix,
            mode,
        } => {
            let lab = lab::Lab::with_mode(&prefix, mode);
            match action {
                LabAction::Up => {
                    lab.up()?;
                    println!(
                        "lab `{prefix}` is up; observe the node with: observer tail --netns {}",
                        lab.node()
                    );
                }
                LabAction::Down => {
                    lab.down();
                    println!("lab `{prefix}` removed");
                }
                LabAction::Status => {
                    for (ns, up) in lab.status() {
                        println!("{ns:<16} {}", if up { "up" } else { "absent" });
                    }
                }
                LabAction::Traffic => {
                    for line in traffic::demo_flows(&lab)? {
                        println!("sent: {line}");
                    }
                }
            }
            Ok(())
        }
    }
}
