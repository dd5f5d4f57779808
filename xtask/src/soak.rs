//! `cargo xtask bench --soak [--minutes N]` (issue 33 §4, "the agent stays flat for weeks"):
//! the agent (release binary, default mode) in the lab's node namespace for N minutes under
//! the churn of a busy node, its memory and open descriptors sampled as it goes:
//!
//! - 20 Mbit/s of 100-byte UDP, client -> pod through the node (iperf3, bounded rate);
//! - a 3-second `tail --agent` session every 8 s (the per-table probes attached, the
//!   ruleset read whole and a rule namer compiled, then all of it let go);
//! - a veth pair added to the node namespace and removed again every 10 s;
//! - a FORWARD rule inserted and deleted every 15 s (a ruleset change: re-read, re-plan).
//!
//! RSS (`/proc/PID/status` VmRSS, `smaps_rollup` anonymous) and open descriptors
//! (`/proc/PID/fd`, by kind) are sampled every few seconds and printed every 30 s. At the
//! end: the troughs' slope after warm-up (least squares over each 30-s window's minimum,
//! MiB an hour, target under 1), the peak (sampled, and the kernel's VmHWM) against 64 MiB,
//! and the descriptors at the end against the start, each taken on a quiet agent (no
//! session open, the linger past). Everything started is stopped and removed, on an
//! error and on ctrl-c too (children run in process groups of their own, so the terminal's
//! SIGINT reaches only this process, which then stops them in order).

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Issue 33's targets.
const SLOPE_TARGET_MIB_H: f64 = 1.0;
const PEAK_TARGET_MIB: f64 = 64.0;
/// How often memory and descriptors are read, and the window whose minimum is a trough.
const SAMPLE: Duration = Duration::from_secs(5);
const WINDOW: Duration = Duration::from_secs(30);
/// The lab's prefix: apart from the other benches' and the tests'.
const PREFIX: &str = "obsoak";
/// The veth pair the churn adds and removes in the node namespace.
const VETH: (&str, &str) = ("soak0a", "soak0b");
/// The FORWARD rule the churn inserts and deletes (nothing sends to that port).
const RULE: &[&str] = &[
    "FORWARD",
    "-p",
    "udp",
    "--dport",
    "10",
    "-m",
    "comment",
    "--comment",
    "observer-soak",
    "-j",
    "DROP",
];

/// Set by SIGINT/SIGTERM: the soak stops at its next second and cleans up.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn catch_signals() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
}

/// One reading of the agent.
#[derive(Clone, Debug)]
struct Sample {
    at: Duration,
    rss_kib: u64,
    anon_kib: u64,
    fds: BTreeMap<String, u64>,
}

impl Sample {
    fn fd_total(&self) -> u64 {
        self.fds.values().sum()
    }
}

fn status_kib(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    kib_field(&text, key)
}

/// `Key:   1234 kB` in a /proc status-like text.
fn kib_field(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// What an fd's link names, without the inode: `socket`, `anon_inode:bpf-link`, `pipe`,
/// `/dev/null`, a netns (`net`), a file.
fn fd_kind(target: &str) -> String {
    if let Some((kind, _)) = target.split_once(":[") {
        return kind.to_string();
    }
    if target.starts_with('/') {
        return "file".into();
    }
    target.to_string()
}

fn read_fds(pid: u32) -> BTreeMap<String, u64> {
    let mut kinds = BTreeMap::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in dir.flatten() {
            let kind = std::fs::read_link(e.path())
                .map(|t| fd_kind(&t.to_string_lossy()))
                .unwrap_or_else(|_| "?".into());
            *kinds.entry(kind).or_insert(0) += 1;
        }
    }
    kinds
}

fn sample(pid: u32, at: Duration) -> Option<Sample> {
    let rss_kib = status_kib(pid, "VmRSS")?;
    let anon_kib = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| kib_field(&t, "Anonymous"))
        .unwrap_or(0);
    Some(Sample {
        at,
        rss_kib,
        anon_kib,
        fds: read_fds(pid),
    })
}

/// Least-squares slope of (x, y).
fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// Each window's lowest RSS (MiB), at the window's middle (hours), from `warmup` on.
fn troughs(samples: &[Sample], warmup: Duration) -> Vec<(f64, f64)> {
    let mut by_window: BTreeMap<u64, f64> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.at >= warmup) {
        let w = s.at.as_secs() / WINDOW.as_secs();
        let mib = s.rss_kib as f64 / 1024.0;
        let e = by_window.entry(w).or_insert(mib);
        *e = e.min(mib);
    }
    by_window
        .into_iter()
        .map(|(w, mib)| ((w as f64 + 0.5) * WINDOW.as_secs_f64() / 3600.0, mib))
        .collect()
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

fn kinds(fds: &BTreeMap<String, u64>) -> String {
    fds.iter()
        .map(|(k, n)| format!("{k}={n}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What the soak started, stopped and removed when it goes (on an error too).
struct Running {
    node: String,
    agent: Option<Child>,
    iperf_server: Option<Child>,
    iperf_client: Option<Child>,
    sessions: Vec<Child>,
    veth: bool,
    rule: bool,
    socket: PathBuf,
}

impl Running {
    fn ip_netns(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.node]).args(args);
        c.stdout(Stdio::null()).stderr(Stdio::null());
        c
    }

    fn veth(&mut self, add: bool) -> Result<()> {
        let mut c = Command::new("ip");
        c.args(["-n", &self.node, "link"]);
        if add {
            c.args(["add", VETH.0, "type", "veth", "peer", "name", VETH.1]);
        } else {
            c.args(["del", VETH.0]);
        }
        let ok = c.stderr(Stdio::null()).status()?.success();
        if add && ok {
            let _ = Command::new("ip")
                .args(["-n", &self.node, "link", "set", VETH.0, "up"])
                .status();
        }
        self.veth = add && ok;
        if !ok && add {
            bail!("ip link add {} in {} failed", VETH.0, self.node);
        }
        Ok(())
    }

    fn rule(&mut self, insert: bool) -> Result<()> {
        let op = if insert { "-I" } else { "-D" };
        let mut args = vec!["iptables", "-w", op];
        args.extend_from_slice(RULE);
        let ok = self.ip_netns(&args).status()?.success();
        self.rule = insert && ok;
        if !ok && insert {
            bail!("inserting the soak's FORWARD rule in {} failed", self.node);
        }
        Ok(())
    }

    /// Sessions that ended are reaped; at most a few can be open (each lasts 3 s).
    fn reap(&mut self) {
        self.sessions
            .retain_mut(|c| matches!(c.try_wait(), Ok(None)));
    }
}

/// Stops a child started by [`own_group`]: `signal`, then SIGKILL after `grace`.
fn kill(child: &mut Child, signal: &str, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    // Its whole group (each child leads one: a wrapper's child goes too).
    let _ = Command::new("kill")
        .args([signal, "--", &format!("-{}", child.id())])
        .status();
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Running {
    fn drop(&mut self) {
        for c in &mut self.sessions {
            kill(c, "-INT", Duration::from_secs(3));
        }
        for c in [self.iperf_client.as_mut(), self.iperf_server.as_mut()]
            .into_iter()
            .flatten()
        {
            kill(c, "-TERM", Duration::from_secs(3));
        }
        if let Some(a) = self.agent.as_mut() {
            kill(a, "-INT", Duration::from_secs(10));
        }
        if self.veth {
            let _ = self.veth(false);
        }
        // Bounded: the rule was inserted once at most per cycle.
        for _ in 0..4 {
            if !self.rule {
                break;
            }
            let _ = self.rule(false);
            let mut args = vec!["iptables", "-w", "-C"];
            args.extend_from_slice(RULE);
            self.rule = self.ip_netns(&args).status().is_ok_and(|s| s.success());
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A command in a process group of its own (the terminal's ctrl-c reaches only xtask).
fn own_group(c: &mut Command) -> &mut Command {
    c.process_group(0)
}

fn start_agent(bin: &Path, node: &str, socket: &Path, log: &Path) -> Result<Child> {
    let ready = std::env::temp_dir().join(format!("observer-soak-ready-{}", std::process::id()));
    let _ = std::fs::remove_file(&ready);
    let log = std::fs::File::create(log)?;
    // `OBSERVER_SOAK_WRAPPER="heaptrack -o /tmp/agent"`: the agent runs under a profiler
    // (whose child it then is: found by its socket, `agent_pid`).
    let wrapper = std::env::var("OBSERVER_SOAK_WRAPPER").unwrap_or_default();
    let mut words = wrapper.split_whitespace();
    let mut cmd = match words.next() {
        Some(w) => {
            let mut c = Command::new(w);
            c.args(words).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let mut child = own_group(
        cmd.args([
            "agent",
            "--netns",
            node,
            "--metrics-addr",
            "127.0.0.1:19967",
        ])
        .arg("--socket")
        .arg(socket)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::null())
        .stderr(log),
    )
    .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while !ready.exists() {
        if let Some(status) = child.try_wait()? {
            bail!("observer agent exited before it was ready: {status}");
        }
        if Instant::now() > deadline || STOP.load(Ordering::SeqCst) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("observer agent not ready within 300 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_file(&ready);
    Ok(child)
}

/// After the last session: its 3 s, the agent's 5-s linger before it detaches, margin.
const QUIET: Duration = Duration::from_secs(12);

fn sleep_unless_stopped(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until && !STOP.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A 3-second `tail --agent` session (the agent attaches its per-table probes for it).
fn tail_session(bin: &Path, socket: &Path) -> Result<Child> {
    Ok(own_group(
        Command::new(bin)
            .args(["tail", "--agent"])
            .arg(socket)
            .args(["--output", "line", "--timeout", "3"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .spawn()?)
}

/// The agent serving `socket` (a child of ours, or of the wrapper's).
fn agent_pid(socket: &Path) -> Option<u32> {
    let socket = socket.to_string_lossy();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_agent = args.get(1).is_some_and(|a| *a == b"agent")
            && args.iter().any(|a| *a == socket.as_bytes());
        is_agent.then_some(pid)
    })
}

/// The soak in an existing lab (`super::in_lab` brings it up and down).
pub fn soak(bin: &Path, minutes: u32) -> Result<()> {
    catch_signals();
    let node = format!("{PREFIX}-node");
    let socket = std::env::temp_dir().join(format!("observer-soak-{}.sock", std::process::id()));
    let log = std::env::temp_dir().join(format!("observer-soak-{}.log", std::process::id()));
    let mut run = Running {
        node: node.clone(),
        agent: None,
        iperf_server: None,
        iperf_client: None,
        sessions: Vec::new(),
        veth: false,
        rule: false,
        socket: socket.clone(),
    };
    run.agent = Some(start_agent(bin, &node, &socket, &log)?);
    let pid = agent_pid(&socket).context("finding the agent's process")?;
    eprintln!(
        "xtask soak: agent pid {pid} in {node}, its log in {}",
        log.display()
    );
    let total = Duration::from_secs(u64::from(minutes) * 60);
    // The UDP stream, bounded in rate and time (restarted if it ends early).
    let iperf_server = || -> Result<Child> {
        Ok(own_group(
            Command::new("ip")
                .args(["netns", "exec", &format!("{PREFIX}-pod")])
                .args(["iperf3", "-s", "-p", "5301"])
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .spawn()?)
    };
    let iperf_client = |secs: u64| -> Result<Child> {
        Ok(own_group(
            Command::new("ip")
                .args(["netns", "exec", &format!("{PREFIX}-client")])
                .args(["iperf3", "-c", "172.17.0.5", "-p", "5301", "-u"])
                .args(["-b", "20M", "-l", "100", "-t", &secs.max(1).to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .spawn()?)
    };
    run.iperf_server = Some(iperf_server()?);
    std::thread::sleep(Duration::from_millis(500));
    run.iperf_client = Some(iperf_client(total.as_secs() + 5)?);
    std::thread::sleep(Duration::from_secs(3));
    let cold = sample(pid, Duration::ZERO).context("reading the agent's /proc")?;
    // One session first: what the first stream loads and keeps loaded (the slot programs,
    // by design) is warm-up, not growth; the start is taken once it has gone quiet again.
    let mut first = tail_session(bin, &socket)?;
    sleep_unless_stopped(Duration::from_secs(5));
    kill(&mut first, "-INT", Duration::from_secs(5));
    sleep_unless_stopped(QUIET);
    let t0 = Instant::now();
    let start = sample(pid, Duration::ZERO).context("reading the agent's /proc")?;
    println!(
        "soak: {minutes} min; cold (quiet, traffic on): RSS {} MiB, fds {}; after one session \
         (quiet): RSS {} MiB, fds {} ({})",
        mib(cold.rss_kib),
        cold.fd_total(),
        mib(start.rss_kib),
        start.fd_total(),
        kinds(&start.fds)
    );
    println!(
        "{:>6}  {:>8}  {:>8}  {:>8}  {:>8}  {:>4}  {:>5}  fds by kind",
        "time", "RSS", "min", "max", "anon", "fds", "load"
    );
    let mut samples = vec![start.clone()];
    let mut window: Vec<Sample> = Vec::new();
    let mut next_sample = SAMPLE;
    let mut next_print = WINDOW;
    let mut second = 0u64;
    let mut restarts = 0;
    // One pass a second, bounded by the soak's length.
    while t0.elapsed() < total && !STOP.load(Ordering::SeqCst) {
        let s = second;
        if s.is_multiple_of(8) {
            run.sessions.push(tail_session(bin, &socket)?);
        }
        match s % 10 {
            0 => run.veth(true)?,
            5 => run.veth(false)?,
            _ => {}
        }
        match s % 15 {
            0 => run.rule(true)?,
            7 => run.rule(false)?,
            _ => {}
        }
        run.reap();
        if run.sessions.len() > 4 {
            bail!(
                "tail --agent sessions do not end: {} open",
                run.sessions.len()
            );
        }
        if let Some(c) = run.iperf_client.as_mut()
            && c.try_wait()?.is_some()
        {
            restarts += 1;
            if restarts > 10 {
                bail!("iperf3 keeps ending; see `ip netns exec {PREFIX}-client iperf3 ...`");
            }
            let left = total.saturating_sub(t0.elapsed()).as_secs() + 5;
            run.iperf_client = Some(iperf_client(left)?);
        }
        if let Some(a) = run.agent.as_mut()
            && let Some(status) = a.try_wait()?
        {
            bail!(
                "the agent exited during the soak: {status} (log: {})",
                log.display()
            );
        }
        second += 1;
        // Sample until the next second's work is due.
        let due = Duration::from_secs(second);
        while t0.elapsed() < due && !STOP.load(Ordering::SeqCst) {
            if t0.elapsed() >= next_sample {
                next_sample += SAMPLE;
                if let Some(x) = sample(pid, t0.elapsed()) {
                    window.push(x.clone());
                    samples.push(x);
                }
            }
            if t0.elapsed() >= next_print && !window.is_empty() {
                next_print += WINDOW;
                let last = window.last().cloned().context("a sample")?;
                let lo = window.iter().map(|s| s.rss_kib).min().unwrap_or(0);
                let hi = window.iter().map(|s| s.rss_kib).max().unwrap_or(0);
                println!(
                    "{:>3}:{:02}  {:>8}  {:>8}  {:>8}  {:>8}  {:>4}  {:>5}  {}",
                    last.at.as_secs() / 60,
                    last.at.as_secs() % 60,
                    mib(last.rss_kib),
                    mib(lo),
                    mib(hi),
                    mib(last.anon_kib),
                    last.fd_total(),
                    super::load_average(),
                    kinds(&last.fds)
                );
                window.clear();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let stopped_early = STOP.load(Ordering::SeqCst);
    // The end, on a quiet agent: no session, no veth or rule of ours, the linger past.
    for c in &mut run.sessions {
        kill(c, "-INT", Duration::from_secs(5));
    }
    run.sessions.clear();
    if run.veth {
        run.veth(false)?;
    }
    if run.rule {
        run.rule(false)?;
    }
    sleep_unless_stopped(QUIET);
    let end = sample(pid, t0.elapsed()).context("reading the agent's /proc")?;
    let hwm = status_kib(pid, "VmHWM").unwrap_or(0);
    samples.push(end.clone());
    drop(run);

    let elapsed = end.at;
    let warmup = Duration::from_secs((u64::from(minutes) * 60 / 6).clamp(120, 300));
    let tr = troughs(&samples, warmup);
    let slope_mib_h = slope(&tr);
    let peak = samples.iter().map(|s| s.rss_kib).max().unwrap_or(0);
    println!(
        "\nsoak: {:.1} min{}; troughs after {} s of warm-up (each 30-s window's lowest RSS, MiB):",
        elapsed.as_secs_f64() / 60.0,
        if stopped_early {
            " (stopped early)"
        } else {
            ""
        },
        warmup.as_secs()
    );
    println!(
        "  {}",
        tr.iter()
            .map(|(_, m)| format!("{m:.1}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let slope_ok = slope_mib_h.is_some_and(|s| s < SLOPE_TARGET_MIB_H);
    let peak_mib = peak.max(hwm) as f64 / 1024.0;
    let peak_ok = peak_mib <= PEAK_TARGET_MIB;
    let fds_ok = end.fd_total() <= start.fd_total();
    let verdict = |ok: bool| if ok { "ok" } else { "MISSED" };
    match slope_mib_h {
        Some(s) => println!(
            "  troughs' slope: {s:+.2} MiB/h (target < {SLOPE_TARGET_MIB_H}): {}",
            verdict(slope_ok)
        ),
        None => println!("  troughs' slope: too short a run to tell"),
    }
    println!(
        "  peak RSS: {} MiB sampled, {} MiB VmHWM (target <= {PEAK_TARGET_MIB}): {}",
        mib(peak),
        mib(hwm),
        verdict(peak_ok)
    );
    println!(
        "  RSS quiet: {} MiB at start, {} MiB at the end",
        mib(start.rss_kib),
        mib(end.rss_kib)
    );
    println!(
        "  fds: {} at start ({}), {} at the end ({}): {}",
        start.fd_total(),
        kinds(&start.fds),
        end.fd_total(),
        kinds(&end.fds),
        verdict(fds_ok)
    );
    if stopped_early {
        bail!(
            "soak stopped by a signal after {:.1} min",
            elapsed.as_secs_f64() / 60.0
        );
    }
    if !(slope_ok && peak_ok && fds_ok) {
        bail!("the soak missed issue 33's targets (above)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_kinds_drop_the_inode() {
        assert_eq!(fd_kind("socket:[12345]"), "socket");
        assert_eq!(fd_kind("anon_inode:bpf-link"), "anon_inode:bpf-link");
        assert_eq!(fd_kind("net:[4026532]"), "net");
        assert_eq!(fd_kind("/dev/null"), "file");
    }

    #[test]
    fn kib_fields_are_read() {
        let t = "Name:\tobserver\nVmHWM:\t   51200 kB\nVmRSS:\t   40960 kB\n";
        assert_eq!(kib_field(t, "VmRSS"), Some(40960));
        assert_eq!(kib_field(t, "VmHWM"), Some(51200));
        assert_eq!(kib_field(t, "VmSwap"), None);
    }

    #[test]
    fn the_slope_of_troughs_is_per_hour() {
        // 1 MiB a minute, the growth: 60 MiB/h, whatever the peaks in between.
        let mut samples = Vec::new();
        for i in 0..120u64 {
            let at = Duration::from_secs(i * 5);
            let base = 40.0 + at.as_secs_f64() / 60.0;
            let peak = if i % 6 == 3 { 15.0 } else { 0.0 };
            samples.push(Sample {
                at,
                rss_kib: ((base + peak) * 1024.0) as u64,
                anon_kib: 0,
                fds: BTreeMap::new(),
            });
        }
        let tr = troughs(&samples, Duration::from_secs(60));
        let s = slope(&tr).unwrap();
        assert!((s - 60.0).abs() < 1.0, "{s}");
        assert!(tr.iter().all(|(_, m)| *m < 51.0));
        assert_eq!(slope(&tr[..1]), None);
    }
}
