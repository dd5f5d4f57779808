//! observer: the real path of every packet through Linux netfilter, seen by eBPF probes.

use observer::commands::{
    agent, explain, kubectl, lab, parse_seconds, replay, tail, traffic, whatif,
};
use observer::pipeline::subscription::Subscription;
use observer::pipeline::{Output, OutputArgs};
use std::io::Write;
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
fallback map) are fixed in size, the collector keeps no per-packet state and drains in batches, \
and reports waiting for a slow reader of standard output are held to 8 MiB (the collector then \
waits); a packet that finds no room is counted as lost, never dropped silently.\n\n\
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
    /// Run as the node's always-on agent: Prometheus metrics, health, a flight recorder of
    /// recent drops and a streaming API for on-demand traces (docs/deploy.md).
    Agent(AgentArgs),
    /// Print the flight recorder of a running agent: its last dropped traversals.
    Drops(DropsArgs),
    /// Print the reports of a `tail --record` file again: same output, no root, no eBPF,
    /// on any machine.
    Replay(ReplayArgs),
    /// Predict a packet's path from the rules alone: every rule that matches, mark and NAT
    /// changes, the verdict (no root, no eBPF; or --live on a node).
    Explain(explain::ExplainArgs),
    /// What would change: hold a recording's traffic against a changed ruleset before the
    /// change is made; prints the flows whose path changes (exit 0: none, 1: some, 2: error).
    Whatif(whatif::WhatifArgs),
    /// Internal: started by observer itself on kernels without tcx, removes its netlink TC
    /// filters when it ends, however it ends (observer::kernel::tc_guard).
    #[command(name = "tc-filter-guard", hide = true)]
    TcFilterGuard,
    /// Build, inspect or remove the built-in netns lab (a Kubernetes-like node).
    Lab {
        #[command(subcommand)]
        action: LabAction,
        /// Prefix of the lab's namespace names (<prefix>-client, <prefix>-node, ...).
        #[arg(long, default_value = "obs", global = true)]
        prefix: String,
        /// With `up`: kube-proxy's mode on the node (nftables: native `kube-proxy` tables,
        /// no KUBE-* iptables rules; ipvs: IPVS virtual services on kube-ipvs0 with Calico,
        /// a CNI hostport and Docker, the third seed's node, in a kernel with IP_VS), or `bridge`: a flannel/kubeadm-style node whose pods
        /// hang off the bridge cni0 with br_netfilter on (`traffic` then sends its flows).
        #[arg(long, value_enum, default_value = "iptables", global = true)]
        mode: lab::Mode,
        /// With `up`: 2 builds the two-node lab instead: <prefix>-node and <prefix>-node2
        /// joined by a VXLAN overlay (flannel.1, VNI 1, UDP 4789 over the underlay veth
        /// eth0), pod 10.244.0.5 on node and pod2 10.244.1.5 on node2, kube-proxy's rules on
        /// both (ClusterIP 10.96.0.30, endpoints on node2: tcp 80 -> 8080, udp 9 -> 9) and a
        /// policy on node2 dropping udp/9 to pod2 (`--mode` does not apply; `traffic` sends
        /// its flows; `down` removes it as any lab).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2), global = true)]
        nodes: u8,
        /// With `up --mode bridge`: also an nft `bridge`-family table (`bridge obs-l2`) whose
        /// chains count bridged frames and drop udp to port 7003 bridged to pod2, as
        /// ebtables/nft bridge filters do (tail annotates bridged reports with what they
        /// did: simulated, confirmed by their counters).
        #[arg(long, global = true)]
        bridge_chains: bool,
    },
}

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    observer tail --netns obs-node --filter 'udp port 53'     # attach here, as root\n  \
    observer tail --agent /run/observer/agent.sock --filter 'host 10.96.0.10'   # ask the agent\n  \
    observer tail --agent 127.0.0.1:9966 --output line --count 100\n  \
    observer tail --agent /run/observer/agent.sock --record node.window --timeout 60   # for whatif")]
struct TailArgs {
    /// Ask a running `observer agent` instead of attaching probes here: its unix socket
    /// path or HOST:PORT (its --listen). The filter, sampling, count and timeout are applied
    /// by the agent for this client alone; the reports are the same.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["netns", "pcapng", "stats", "ready_file", "marks", "floor", "trace_bridge_chains", "backend"])]
    agent: Option<String>,
    /// `ip netns` name to observe (default: the current namespace).
    #[arg(long)]
    netns: Option<String>,
    /// The capture backend that puts the per-table probes in place: `links` (BPF netfilter
    /// links, Linux 6.4+: a probe at each point's own priority, sees everything) or
    /// `fentry` (fentry/fexit trampolines on the functions the tables run: nft_do_chain,
    /// nf_nat_inet_fn, nf_conntrack_in, ipt_do_table; for older kernels such as 6.1; what
    /// it cannot see is said at start). Default: links where the kernel has them, else
    /// fentry. The summary says which one captured.
    #[arg(long, value_name = "links|fentry")]
    backend: Option<observer::kernel::capture::BackendKind>,
    #[command(flatten)]
    output: OutputArgs,
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
    /// Observe the nft `bridge` family's chains instead of simulating them: observer adds
    /// its own bridge-family table `observer-trace-<pid>` (chains first on every bridge hook
    /// whose only rules set `meta nftrace` on IPv4/IPv6 frames: no frame's fate changes) and
    /// reads nf_tables' trace events, so a bridged report names each bridge-family chain
    /// and rule the frame met, a drop there included. The table is owned by observer's
    /// netlink socket: the kernel removes it when observer exits, even on SIGKILL. Users of
    /// `nft monitor trace` on the node see its frames while it runs (docs/rules.md).
    #[arg(long)]
    trace_bridge_chains: bool,
    /// Also save every traversal record, with the probe plan, kernel layout, interface
    /// names, kernel symbols and mark names its report needs, to FILE; `observer replay
    /// FILE` prints the same reports later, anywhere, without root (docs/recording.md).
    /// With --agent: a capture window instead, the agent's reports as JSON with the node's
    /// ruleset read through the agent when the window opened (bound it with --timeout or
    /// --count); `observer whatif --recording FILE --ruleset NEW` holds it against a changed
    /// ruleset (docs/whatif.md). Only --output json prints the reports too.
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Also write each printed traversal's packet to FILE as pcap-ng, for Wireshark or
    /// tshark: its first 128 bytes from the IP header (LINKTYPE_RAW), taken where the
    /// traversal started, on an interface block per interface it entered on, with the
    /// traversal's one-line report as the packet comment (`tshark -r FILE -V`, or the
    /// `frame.comment` field). Without it the probes only check a flag.
    #[arg(long, value_name = "FILE")]
    pcapng: Option<PathBuf>,
    /// Reports carry each IPv4 packet's identification (`packet.ip_id`, and a tunnel
    /// carrier's `encap.inner_ip_id`): what finds one packet in a capture (tcpdump's `id`,
    /// tshark's `ip.id`) or on another node. Each packet then gets a report of its own:
    /// the rendering a flow's packets otherwise share is not reused, which costs CPU.
    #[arg(long)]
    ip_ids: bool,
}

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    observer tail --netns obs-node --record node.obsrec   # as root, on the node\n  \
    observer replay node.obsrec                          # anywhere, no root\n  \
    observer replay --json node.obsrec | jq -c .fate\n\n\
The file holds the raw records with the probe plan, kernel layout, interface names, kernel \
symbols and mark names they need (docs/recording.md); a recording of another format or record \
layout is refused with the version that can read it. It holds records, not a format: any \
--output works.")]
struct ReplayArgs {
    /// A file written by `observer tail --record FILE`.
    file: PathBuf,
    #[command(flatten)]
    output: OutputArgs,
    /// Stop after printing N traversals.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Print only the traversals this pcap-filter subset keeps (docs/filter.md), decided
    /// from the record as the probes decide after conntrack: by the packet as it entered
    /// and its connection's tuples; interface names are the recording's.
    #[arg(long, value_name = "EXPR")]
    filter: Option<String>,
}

#[derive(clap::Args)]
#[command(after_help = "Examples:\n  \
    observer agent                                   # on a node, as root\n  \
    observer agent --node-netns /host/node-netns --listen 127.0.0.1:9966   # the DaemonSet's way\n  \
    observer agent --netns obs-node --metrics-addr 127.0.0.1:9965 --socket /tmp/obs.sock\n  \
    curl -s 127.0.0.1:9965/metrics | grep observer_drops_total\n  \
    curl -s --unix-socket /run/observer/agent.sock 'http://x/v1/traces?filter=udp&count=5'\n  \
    curl -s -X POST --unix-socket /run/observer/agent.sock 'http://x/v1/arm?seconds=30&filter=udp'\n  \
    observer agent --arm-drop-rate NETFILTER_DROP=100 --window 2s/60s\n\n\
Endpoints: /metrics, /healthz, /readyz on --metrics-addr; /v1/traces (filter, output, sample, \
count, timeout as query parameters), /v1/drops, /v1/names (services and pods by address), \
/v1/version and /v1/arm (GET: tier 2's state; POST ?seconds=N&filter=EXPR: per-table brackets for \
N seconds, their traversals into the flight recorder) on the unix socket and on --listen (`kubectl observer` reaches it by port-forward: \
--listen 127.0.0.1:9966, in the pod's own namespace with --node-netns, where nothing of the \
node's namespace can connect). Traces and drops stream NDJSON: `tail --json` reports (or {\"text\": ...} for tree and line output), \
{\"agent\": {\"skipped\": N}} when a slow client missed N traversals, and a closing \
{\"agent\": {\"end\": ...}} line with what the stream carried. SIGTERM or SIGINT: the probes \
are detached, the streams closed, exit 0.")]
struct AgentArgs {
    /// `ip netns` name (or a namespace file's path) to observe and to live in (default: the
    /// current namespace). The TCP listeners (--metrics-addr, --listen) bind there too.
    #[arg(long, value_name = "NAME|PATH")]
    netns: Option<String>,
    /// The network namespace to observe (the node's) while the TCP listeners
    /// (--metrics-addr, --listen) stay in the one the agent starts in (its pod's): `ip netns`
    /// name, or a namespace file's path (the DaemonSet mounts the node's /proc/1/ns/net).
    /// Only the pod's namespace can reach --listen then (the runtime's port-forward, so
    /// `kubectl observer` as RBAC grants); no process of the node's namespace can, root or
    /// not. The probes attach, and the ruleset, interfaces and conntrack are read, in the
    /// node's. Needs CAP_SYS_ADMIN to enter it; dropped right after, with no_new_privs set.
    #[arg(long, value_name = "NAME|PATH", conflicts_with = "netns")]
    node_netns: Option<String>,
    /// The capture backend that puts the per-table probes in place: `links` (BPF netfilter
    /// links, Linux 6.4+: a probe at each point's own priority, sees everything) or
    /// `fentry` (fentry/fexit trampolines on the functions the tables run: nft_do_chain,
    /// nf_nat_inet_fn, nf_conntrack_in, ipt_do_table; for older kernels such as 6.1; what
    /// it cannot see is said at start). Default: links where the kernel has them, else
    /// fentry. The ready line and observer_capture_backend say which one.
    #[arg(long, value_name = "links|fentry")]
    backend: Option<observer::kernel::capture::BackendKind>,
    /// Where to serve /metrics, /healthz and /readyz (HTTP).
    #[arg(long, value_name = "HOST:PORT", default_value = "0.0.0.0:9965")]
    metrics_addr: String,
    /// The streaming API's unix socket (created mode 0600: traces carry addresses).
    #[arg(long, value_name = "PATH", default_value = agent::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Also serve the streaming API on TCP: it answers only sockets owned by root in the
    /// namespace it is bound in. Bind it to loopback, with --node-netns the pod's, and
    /// reach it through `kubectl port-forward`.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<String>,
    /// TOML file naming mark bits (as `tail --marks`).
    #[arg(long, value_name = "FILE")]
    marks: Option<PathBuf>,
    /// How many dropped traversals the flight recorder keeps (the newest).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    flight_recorder: usize,
    /// Memory the flight recorder may use at most, in MiB (older drops go first).
    #[arg(long, value_name = "MIB", default_value_t = 16)]
    flight_recorder_mib: usize,
    /// The `node` label of every metric (the DaemonSet passes spec.nodeName).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
    /// A packet followed this long without its end is reported as incomplete.
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    idle_ms: u64,
    /// Write this file once the probes are attached (tests and scripts).
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,
    /// What the probes do while nobody streams traces.
    #[arg(long, value_enum, default_value = "kernel")]
    mode: agent::AgentMode,
    /// How often the rules' own counters and conntrack's statistics are read (tier 0;
    /// every mode), in seconds: set it to the Prometheus scrape interval.
    #[arg(long, value_name = "SECONDS", default_value_t = 15.0)]
    rules_interval: f64,
    /// Series the rule counters may make at most; rules past it are counted in
    /// observer_rule_series_left_out instead.
    #[arg(long, value_name = "N", default_value_t = observer_nfstats::DEFAULT_CAP)]
    rule_series_cap: usize,
    /// Default mode (tier 1): the least time between two samples of dropped packets on
    /// one CPU, in seconds (0: no samples). Samples go to the flight recorder (`observer
    /// drops --agent`); a NETFILTER_DROP one names its rule.
    #[arg(long, value_name = "SECONDS", default_value_t = 0.1)]
    drop_sample_gap: f64,
    /// Default mode (tier 1): a drop reason the kernel neither counts by key nor samples
    /// (repeat it; names as in observer_kernel_drops_total, e.g. NOT_SPECIFIED).
    #[arg(long, value_name = "REASON")]
    drop_reasons_ignored: Vec<String>,
    /// Tier 2: arm the per-table brackets for --arm-seconds when a drop reason's rate
    /// (tier 1's counts, read each second) goes above RATE packets per second:
    /// REASON=RATE (e.g. NETFILTER_DROP=100) or RATE alone for any reason; repeat it. The
    /// traversals of the flows tier 1 sampled go to the flight recorder whole.
    #[arg(long, value_name = "[REASON=]RATE", value_parser = agent::tier2::parse_drop_rate)]
    arm_drop_rate: Vec<agent::tier2::DropRate>,
    /// Tier 2: arm the brackets for --arm-seconds when conntrack's insert_failed grows
    /// (read each second; the DNS five-second delay shows up there).
    #[arg(long)]
    arm_on_insert_failed: bool,
    /// Tier 2: how long an arm by --arm-drop-rate or --arm-on-insert-failed lasts, in
    /// seconds (1 to 600).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    arm_seconds: f64,
    /// Observe the nft `bridge` family's chains through nf_tables' trace instead of
    /// simulating them, as `observer tail --trace-bridge-chains` does: a bridge-family table
    /// `observer-trace-<pid>` of the agent's own (its chains only set `meta nftrace` on
    /// IPv4/IPv6 frames; the kernel removes it when the agent exits, even on SIGKILL).
    /// Every bridged IP frame is then traced while the agent runs; `nft monitor trace`
    /// users see it (docs/rules.md).
    #[arg(long)]
    trace_bridge_chains: bool,
    /// Tier 2: the least time from the end of an arm by a condition to the next, in
    /// seconds (0 to 86400): a lasting flood of drops arms the brackets at most
    /// --arm-seconds in every --arm-cooldown.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    arm_cooldown: f64,
    /// Tier 2's duty cycle: arm the brackets for ON at the start of every PERIOD, e.g.
    /// 2s/60s (units ms, s, m, h): a rolling sample of whole traversals in the flight
    /// recorder for about ON/PERIOD of --mode brackets' cost. ON at least 1 s and at most
    /// half of PERIOD.
    #[arg(long, value_name = "ON/PERIOD", value_parser = agent::tier2::parse_window)]
    window: Option<agent::tier2::Window>,
    /// Benchmarks only: attach the probes of --mode but let each return at once (the
    /// hooks' own cost).
    #[arg(long, hide = true)]
    floor: bool,
}

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  observer drops --agent /run/observer/agent.sock --output line --filter 'tcp'\n  \
    observer drops --agent /run/observer/agent.sock --record drops.window   # for observer whatif"
)]
struct DropsArgs {
    /// The agent's unix socket path, or HOST:PORT (its --listen).
    #[arg(long, value_name = "ADDR", default_value = agent::DEFAULT_SOCKET)]
    agent: String,
    #[command(flatten)]
    output: OutputArgs,
    /// Only the drops this pcap-filter subset keeps (docs/filter.md).
    #[arg(long, value_name = "EXPR")]
    filter: Option<String>,
    /// Only the newest N.
    #[arg(long, value_name = "N")]
    count: Option<u64>,
    /// Also save the drops as a capture window: their reports as JSON with the node's
    /// ruleset, read through the agent now, for `observer whatif --recording FILE`. A drop
    /// sample of the default mode is seen only where it died: whatif lists it as
    /// undecidable; an armed window's drops (`POST /v1/arm`) are whole (docs/whatif.md).
    /// Only --output json prints them too.
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
}

#[derive(Subcommand)]
enum LabAction {
    /// Create the namespaces, links, addresses and the node's iptables rules and ipsets.
    Up,
    /// Remove every namespace of the lab.
    Down,
    /// Show which of the lab's namespaces exist.
    Status,
    /// Send the demo flows through the lab (client -> ClusterIP, pod -> external, client -> node;
    /// on a bridge lab: pod -> pod, pod -> ClusterIP on the same bridge, hairpin, remote, outside;
    /// on the two-node lab: pod -> ClusterIP tcp/80 delivered to pod2 on node2 through the
    /// overlay, pod2 -> pod direct, pod -> ClusterIP udp/9 dropped by node2's policy).
    Traffic,
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    // Started as `kubectl-observer` (by kubectl, or a symlink): the cluster plugin.
    if std::env::args_os()
        .next()
        .is_some_and(|a| kubectl::invoked_as_plugin(&a))
    {
        if let Err(e) = kubectl::main(kubectl::PluginCli::parse()) {
            eprintln!("kubectl observer: error: {e:#}");
            std::process::exit(1);
        }
        return;
    }
    let cli = Cli::parse();
    // whatif is a gate: 0 nothing changes, 1 something does, 2 it could not tell.
    if let Command::Whatif(a) = &cli.command {
        match whatif::run(a, &mut std::io::stdout().lock()) {
            Ok(changed) => std::process::exit(i32::from(changed)),
            Err(e) => {
                eprintln!("observer: error: {e:#}");
                std::process::exit(2);
            }
        }
    }
    if let Err(e) = run(cli) {
        eprintln!("observer: error: {e:#}");
        std::process::exit(1);
    }
}

impl TailArgs {
    /// What to print, the same for a local tail and one from an agent.
    fn wants(&self) -> Subscription {
        Subscription {
            output: self.output.format(),
            filter: self.filter.clone(),
            sample: self.sample,
            count: self.count,
            timeout: self.timeout,
            ip_ids: self.ip_ids,
        }
    }
}

/// `secs` as a duration when `range` holds it; otherwise the error `says`.
fn seconds_within(secs: f64, range: std::ops::RangeInclusive<f64>, says: &str) -> Result<Duration> {
    if range.contains(&secs) {
        Ok(Duration::from_secs_f64(secs))
    } else {
        anyhow::bail!("{says}")
    }
}

/// Writes `text` and a newline to stdout; a reader that went away (`| head`) ends the
/// output, not the process with a panic.
fn print_stdout(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Records a capture window from an agent into `file` (`tail --agent --record`, `drops
/// --agent --record`); the reports go to stdout too with `--output json`.
fn window_from_agent(
    opts: agent::client::ClientOptions,
    path: &'static str,
    file: PathBuf,
) -> Result<()> {
    let tee: Option<Box<dyn Write + Send>> = if opts.wants.output == Output::Json {
        Some(Box::new(std::io::stdout()))
    } else {
        None
    };
    let (summary, end) = agent::window::record(agent::window::WindowOptions {
        agent_label: opts.agent.clone(),
        client: opts,
        path,
        file: file.clone(),
        node: None,
        say_opened: tee.is_none(),
        tee,
    })?;
    eprintln!("{summary}");
    eprintln!(
        "observer: {} reports recorded to {}, with the node's ruleset",
        end.reports,
        file.display()
    );
    if end.ruleset_changed {
        eprintln!(
            "observer: warning: the node's rules changed while the window was open: whatif \
             holds every report against the rules read when it opened"
        );
    }
    if let Some(why) = summary.end.as_ref().and_then(|e| e.get("why")) {
        anyhow::bail!(
            "the agent could not serve this stream: {}",
            why.as_str().unwrap_or("")
        );
    }
    Ok(())
}

/// Prints what an agent streams from `path`, then its summary on stderr.
fn from_agent(opts: agent::client::ClientOptions, path: &str) -> Result<()> {
    let summary = agent::client::run(&opts, path, std::io::stdout())?;
    eprintln!("{summary}");
    // The agent could not serve the stream (its kernel refuses the per-table probes): an
    // error, not an empty answer.
    if let Some(why) = summary.end.as_ref().and_then(|e| e.get("why")) {
        anyhow::bail!(
            "the agent could not serve this stream: {}",
            why.as_str().unwrap_or("")
        );
    }
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::TcFilterGuard => {
            let (deleted, failures) = observer::kernel::tc_guard::serve(std::io::stdin().lock());
            if deleted > 0 {
                eprintln!(
                    "observer: removed {deleted} TC filter(s) observer left attached when it ended"
                );
            }
            for f in &failures {
                eprintln!(
                    "observer: could not remove the TC filter observer left on {f}: \
                     `tc filter del dev IFACE ingress|egress pref N` removes it"
                );
            }
            if failures.is_empty() {
                Ok(())
            } else {
                anyhow::bail!("{} TC filter(s) left attached", failures.len())
            }
        }
        Command::Tail(mut a) if a.agent.is_some() && a.record.is_some() => window_from_agent(
            agent::client::ClientOptions {
                wants: a.wants(),
                agent: a.agent.take().unwrap_or_default(),
                stop: None,
            },
            "/v1/traces",
            a.record.take().unwrap_or_default(),
        ),
        Command::Tail(a) if a.agent.is_some() => from_agent(
            agent::client::ClientOptions {
                wants: a.wants(),
                agent: a.agent.unwrap_or_default(),
                stop: None,
            },
            "/v1/traces",
        ),
        Command::Drops(a) => {
            let opts = agent::client::ClientOptions {
                agent: a.agent,
                wants: Subscription {
                    filter: a.filter,
                    count: a.count,
                    ..Subscription::new(a.output.format())
                },
                stop: None,
            };
            match a.record {
                Some(file) => window_from_agent(opts, "/v1/drops", file),
                None => from_agent(opts, "/v1/drops"),
            }
        }
        Command::Agent(a) => {
            observer::kernel::capture::request(a.backend);
            let node = a.node_name.unwrap_or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_default()
            });
            let stopped_by = agent::run(agent::AgentOptions {
                netns: a.netns,
                node_netns: a.node_netns,
                metrics_addr: a.metrics_addr,
                socket: a.socket,
                listen: a.listen,
                marks_file: a.marks,
                flight_recorder: a.flight_recorder,
                flight_recorder_bytes: a.flight_recorder_mib.saturating_mul(1 << 20),
                node,
                idle: Duration::from_millis(a.idle_ms),
                ready_file: a.ready_file,
                mode: a.mode,
                floor: a.floor,
                rules_interval: Duration::try_from_secs_f64(a.rules_interval)
                    .ok()
                    .filter(|d| *d >= Duration::from_millis(100))
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "--rules-interval must be at least 0.1 seconds (give the scrape interval, e.g. 15)"
                        )
                    })?,
                rule_series_cap: a.rule_series_cap,
                drop_sample_gap: (a.drop_sample_gap > 0.0)
                    .then(|| Duration::try_from_secs_f64(a.drop_sample_gap))
                    .transpose()
                    .map_err(|_| {
                        anyhow::anyhow!("--drop-sample-gap must be a number of seconds, e.g. 0.1")
                    })?,
                drop_reasons_ignored: a.drop_reasons_ignored,
                tier2: agent::tier2::Tier2Options {
                    arm_seconds: seconds_within(
                        a.arm_seconds,
                        1.0..=600.0,
                        "--arm-seconds must be 1 to 600 (seconds armed)",
                    )?,
                    cooldown: seconds_within(
                        a.arm_cooldown,
                        0.0..=86400.0,
                        "--arm-cooldown must be 0 to 86400 seconds",
                    )?,
                    drop_rates: a.arm_drop_rate,
                    insert_failed: a.arm_on_insert_failed,
                    window: a.window,
                },
                trace_bridge_chains: a.trace_bridge_chains,
            })?;
            eprintln!("observer agent: stopped by {stopped_by}");
            Ok(())
        }
        Command::Tail(a) => {
            observer::kernel::capture::request(a.backend);
            let summary = tail::run(tail::TailOptions {
                wants: a.wants(),
                netns: a.netns,
                marks_file: a.marks,
                ready_file: a.ready_file,
                idle: Duration::from_millis(a.idle_ms),
                stats_file: a.stats,
                floor: a.floor,
                rules: !a.no_rules,
                record: a.record,
                pcapng: a.pcapng,
                trace_bridge_chains: a.trace_bridge_chains,
            })?;
            eprintln!("{summary}");
            Ok(())
        }
        Command::Replay(a) => {
            let summary = replay::run(
                &replay::ReplayOptions {
                    file: a.file,
                    output: a.output.format(),
                    count: a.count,
                    filter: a.filter,
                },
                &mut std::io::stdout().lock(),
            )?;
            eprintln!("{summary}");
            Ok(())
        }
        Command::Explain(a) => print_stdout(&explain::run(a)?.to_string()),
        Command::Whatif(_) => unreachable!("run by main: its exit status is its answer"),
        Command::Lab {
            action,
            prefix,
            mode,
            nodes,
            bridge_chains,
        } => {
            let lab = if nodes == 2 {
                lab::Lab::two_nodes(&prefix)
            } else {
                lab::Lab::with_mode(&prefix, mode)
            };
            match action {
                LabAction::Up if nodes == 2 => {
                    lab.up()?;
                    println!(
                        "two-node lab `{prefix}` is up; observe each node with: \
                         observer tail --netns {} (and --netns {})",
                        lab.node(),
                        lab.ns("node2")
                    );
                }
                LabAction::Up => {
                    if bridge_chains && mode != lab::Mode::Bridge {
                        anyhow::bail!("--bridge-chains goes with --mode bridge");
                    }
                    lab.up()?;
                    if bridge_chains {
                        lab::bridge::add_bridge_chains(&lab)?;
                    }
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
                    let flows = if nodes == 2 || lab.detect_overlay() {
                        traffic::overlay_flows(&lab)?
                    } else if mode == lab::Mode::Bridge || lab.detect_bridge() {
                        traffic::bridge_flows(&lab)?
                    } else if mode == lab::Mode::Ipvs || lab.detect_ipvs() {
                        traffic::ipvs_flows(&lab)?
                    } else {
                        traffic::demo_flows(&lab)?
                    };
                    for line in flows {
                        println!("sent: {line}");
                    }
                }
            }
            Ok(())
        }
    }
}
