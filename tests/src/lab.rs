//! The built-in lab for end-to-end tests: a lab instance per test (unique prefix), the
//! observer attached to its node, sockets run inside its namespaces, and helpers to read
//! the observer's JSON reports. Everything is removed on drop, even when a test fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::printed::Printed;
use crate::{enter_netns, run, unique_prefix};

/// How long a test's socket waits for its peer. Servers are bound before the observer
/// starts, whose attach can take seconds on a loaded machine (tests run in parallel): a
/// timeout that ran out meanwhile would close the socket and the kernel would rightly drop
/// the packet (NO_SOCKET). Only a failing test waits this long.
pub const TIMEOUT: Duration = Duration::from_secs(30);

pub fn observer_bin() -> PathBuf {
    if let Ok(p) = std::env::var("OBSERVER_BIN") {
        return PathBuf::from(p);
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/observer");
    assert!(
        p.exists(),
        "no observer binary at {}: run the tests with `cargo xtask test`",
        p.display()
    );
    p
}

/// A lab instance, removed on drop.
pub struct Lab {
    pub prefix: String,
}

impl Lab {
    pub fn up(tag: &str) -> Self {
        Self::up_with_mode(tag, "iptables")
    }

    /// A lab whose kube-proxy runs in `mode` (`iptables` or `nftables`).
    pub fn up_with_mode(tag: &str, mode: &str) -> Self {
        Self::up_with_args(tag, mode, &[])
    }

    /// A lab in `mode` with more `lab up` arguments (`--bridge-chains`).
    pub fn up_with_args(tag: &str, mode: &str, extra: &[&str]) -> Self {
        let prefix = unique_prefix(tag);
        let lab = Self { prefix };
        let mut args = vec![
            observer_bin().to_str().unwrap().to_string(),
            "lab".into(),
            "up".into(),
            "--prefix".into(),
            lab.prefix.clone(),
            "--mode".into(),
            mode.into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        run(&args.iter().map(String::as_str).collect::<Vec<_>>());
        lab
    }

    /// The two-node lab (`observer lab up --nodes 2`): `node` and `node2` joined by VXLAN.
    pub fn up_two_nodes(tag: &str) -> Self {
        let prefix = unique_prefix(tag);
        let lab = Self { prefix };
        run(&[
            observer_bin().to_str().unwrap(),
            "lab",
            "up",
            "--prefix",
            &lab.prefix,
            "--nodes",
            "2",
        ]);
        lab
    }

    /// `observer lab traffic`: the demo flows (client -> ClusterIP, pod -> external,
    /// client -> node).
    pub fn traffic(&self) {
        run(&[
            observer_bin().to_str().unwrap(),
            "lab",
            "traffic",
            "--prefix",
            &self.prefix,
        ]);
    }

    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    pub fn ns_path(&self, role: &str) -> PathBuf {
        PathBuf::from("/run/netns").join(self.ns(role))
    }

    /// Runs `f` on a thread inside the lab namespace `role`.
    pub fn run_in<F, R>(&self, role: &str, f: F) -> R
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let path = self.ns_path(role);
        std::thread::spawn(move || {
            enter_netns(&path);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// Starts a server thread inside `role`; returns once it is bound.
    pub fn serve<F>(&self, role: &str, f: F) -> std::thread::JoinHandle<()>
    where
        F: FnOnce(std::sync::mpsc::Sender<()>) + Send + 'static,
    {
        let path = self.ns_path(role);
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            enter_netns(&path);
            f(tx)
        });
        rx.recv_timeout(TIMEOUT).expect("server bound");
        h
    }

    /// Rule and policy counter lines of `table` on the node (all tables when None).
    pub fn iptables_counters(&self, table: Option<&str>) -> Vec<String> {
        let node = self.ns("node");
        let mut args = vec!["ip", "netns", "exec", node.as_str(), "iptables-save", "-c"];
        if let Some(t) = table {
            args.extend(["-t", t]);
        }
        let out = run(&args);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with('[') || l.starts_with(':'))
            .map(str::to_string)
            .collect()
    }

    pub fn reset_counters(&self) {
        for t in ["raw", "mangle", "nat", "filter"] {
            run(&[
                "ip",
                "netns",
                "exec",
                &self.ns("node"),
                "iptables",
                "-t",
                t,
                "-Z",
            ]);
        }
        run(&["ip", "netns", "exec", &self.ns("node"), "conntrack", "-F"]);
    }
}

impl Drop for Lab {
    /// Never panics (a panic while a failing test unwinds would abort and leave the
    /// namespaces behind): without the observer binary, the lab's namespaces are deleted
    /// by name.
    fn drop(&mut self) {
        let bin = std::env::var_os("OBSERVER_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/observer")
            });
        let down = Command::new(bin)
            .args(["lab", "down", "--prefix", &self.prefix])
            .output()
            .is_ok_and(|o| o.status.success());
        if down {
            return;
        }
        let listed = Command::new("ip").args(["netns", "list"]).output();
        let text = listed
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mine = format!("{}-", self.prefix);
        for name in text.lines().filter_map(|l| l.split_whitespace().next()) {
            if name.starts_with(&mine) {
                let _ = Command::new("ip").args(["netns", "del", name]).output();
            }
        }
    }
}

/// `observer tail --json` on the lab's node; killed on drop if still running.
pub struct Tail {
    child: Option<Child>,
    /// The observer's stdout, read as it comes.
    stdout: Option<Printed>,
}

impl Tail {
    /// Process id of the running observer.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Whether the observer has exited (without reaping its output).
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_some())
    }

    pub fn start(lab: &Lab) -> Self {
        Self::start_with(lab, &[])
    }

    /// Starts the observer with extra `tail` arguments (e.g. a filter).
    pub fn start_with(lab: &Lab, extra: &[&str]) -> Self {
        Self::start_with_env(lab, extra, &[])
    }

    /// Like [`Self::start_with`], with extra environment variables for the observer.
    pub fn start_with_env(lab: &Lab, extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_on(lab, "node", extra, env)
    }

    /// Starts the observer on the lab's namespace `role` (`node2` of the two-node lab).
    pub fn start_on(lab: &Lab, role: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let ready = std::env::temp_dir().join(format!("{}-{role}-ready", lab.prefix));
        let _ = std::fs::remove_file(&ready);
        let child = Command::new(observer_bin())
            .args([
                "tail",
                "--json",
                "--timeout",
                "60",
                "--netns",
                &lab.ns(role),
            ])
            .args(extra)
            .envs(env.iter().copied())
            .arg("--ready-file")
            .arg(&ready)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn observer tail");
        let mut child = child;
        let reader = Printed::read(child.stdout.take().expect("piped stdout"));
        let mut tail = Self {
            child: Some(child),
            stdout: Some(reader),
        };
        // Attaching verifies every probe program: seconds here, minutes under a guest's
        // software emulation on a loaded machine (fentry's trampolines on 6.12: 224 s).
        let deadline = Instant::now() + Duration::from_secs(60) * crate::time_scale();
        while !ready.exists() {
            if let Some(status) = tail.child.as_mut().unwrap().try_wait().unwrap() {
                let mut err = String::new();
                let _ = tail
                    .child
                    .take()
                    .unwrap()
                    .stderr
                    .unwrap()
                    .read_to_string(&mut err);
                panic!("observer tail exited before ready ({status}): {err}");
            }
            assert!(
                Instant::now() < deadline,
                "observer tail not ready in {} s",
                60 * crate::time_scale()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        tail
    }

    /// Waits (within `within`) until `n` whole report lines satisfy `pred`.
    pub fn wait_for(&self, what: &str, within: Duration, n: usize, pred: impl Fn(&str) -> bool) {
        self.stdout
            .as_ref()
            .expect("running")
            .wait_for(what, within, n, pred);
    }

    /// Stops the observer (SIGINT, as a user would) and returns its JSON reports.
    pub fn stop(mut self) -> (Vec<Value>, String) {
        // Let idle traversals close (idle time 1 s) before stopping.
        std::thread::sleep(Duration::from_millis(1500));
        let mut child = self.child.take().unwrap();
        if child.try_wait().ok().flatten().is_none() {
            run(&["kill", "-INT", &child.id().to_string()]);
        }
        let out = child.wait_with_output().expect("observer exits");
        let stdout = self.stdout.take().map(Printed::finish).unwrap_or_default();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "observer failed: {stderr}");
        let reports = String::from_utf8_lossy(&stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l}: {e}")))
            .collect();
        (reports, stderr)
    }
}

impl Drop for Tail {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn tcp_echo(
    lab: &Lab,
    role: &str,
    addr: &'static str,
    conns: usize,
) -> std::thread::JoinHandle<()> {
    lab.serve(role, move |ready| {
        let l = TcpListener::bind(addr).expect("bind");
        ready.send(()).unwrap();
        for _ in 0..conns {
            let (mut s, _) = l.accept().expect("accept");
            s.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut buf = [0u8; 64];
            let n = s.read(&mut buf).unwrap_or(0);
            s.write_all(&buf[..n]).unwrap();
        }
    })
}

pub fn tcp_client(lab: &Lab, role: &str, to: &'static str) -> Result<Vec<u8>, String> {
    lab.run_in(role, move || {
        let to: SocketAddr = to.parse().unwrap();
        let mut s = TcpStream::connect_timeout(&to, TIMEOUT).map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        s.write_all(b"ping").map_err(|e| e.to_string())?;
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut back = Vec::new();
        s.read_to_end(&mut back).map_err(|e| e.to_string())?;
        Ok(back)
    })
}

pub fn stage<'a>(r: &'a Value, hook: &str, table: &str) -> Option<&'a Value> {
    r["stages"]
        .as_array()?
        .iter()
        .find(|s| s["hook"] == hook && s["table"] == table)
}

pub fn mark(v: &Value) -> u32 {
    let s = v["mark"].as_str().expect("mark string");
    u32::from_str_radix(s.trim_start_matches("0x"), 16).expect("hex mark")
}

pub fn first_dst(r: &Value) -> &str {
    r["stages"][0]["before"]["dst"].as_str().unwrap_or("")
}

/// The common shape of a traced request: an echo server at `server` in namespace
/// `server_role`, the observer on the node, one round trip from `client_role` to `to`.
/// Returns the observer's reports and its stderr (with the summary line).
pub fn traced_roundtrip(
    lab: &Lab,
    server_role: &str,
    server: &'static str,
    client_role: &str,
    to: &'static str,
) -> (Vec<Value>, String) {
    let echo = tcp_echo(lab, server_role, server, 1);
    let tail = Tail::start(lab);
    assert_eq!(tcp_client(lab, client_role, to).unwrap(), b"ping");
    echo.join().unwrap();
    tail.stop()
}

/// A UDP socket bound at `addr` inside `role` that waits (up to [`TIMEOUT`]) for one
/// datagram: something to deliver to, so traffic to it is not answered by port unreachable.
pub fn udp_sink(lab: &Lab, role: &str, addr: &'static str) -> std::thread::JoinHandle<()> {
    lab.serve(role, move |ready| {
        let s = std::net::UdpSocket::bind(addr).unwrap();
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        ready.send(()).unwrap();
        let mut buf = [0u8; 64];
        let _ = s.recv(&mut buf);
    })
}

/// Drops UDP to the pod's `port` in the lab node's FORWARD chain (inserted first).
pub fn drop_udp_port(lab: &Lab, port: u16) {
    crate::run(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("node"),
        "iptables",
        "-I",
        "FORWARD",
        "-p",
        "udp",
        "--dport",
        &port.to_string(),
        "-j",
        "DROP",
    ]);
}
