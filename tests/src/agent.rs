//! `observer agent` in the lab for the end-to-end tests: started on the lab's node with its
//! own socket, killed on drop; HTTP from inside the node namespace; its streaming clients.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::lab::{Lab, observer_bin};
use crate::printed::Printed;

/// Where the agent serves metrics, inside the lab's node namespace.
pub const METRICS: &str = "127.0.0.1:9965";

pub struct Agent {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub ready: PathBuf,
    /// The agent's stderr, drained as it comes: a pipe nobody reads fills at 64 KiB and
    /// stalls the agent's next write (a test would then blame the agent).
    err: Option<std::thread::JoinHandle<Vec<u8>>>,
}

impl Agent {
    /// Starts the agent on `lab`'s node in `--mode brackets` (per-table probes always on)
    /// and waits until its probes are attached.
    pub fn start(lab: &Lab) -> Self {
        Self::start_with(lab, &["--mode", "brackets"])
    }

    /// Starts the agent with `extra` arguments only (no `--mode`: the default mode).
    pub fn start_with(lab: &Lab, extra: &[&str]) -> Self {
        let mut cmd = Command::new(observer_bin());
        cmd.args([
            "agent",
            "--netns",
            &lab.ns("node"),
            "--metrics-addr",
            METRICS,
        ]);
        Self::spawn(lab, cmd, extra)
    }

    /// Starts the agent as the DaemonSet runs it: in a pod's own namespace `pod` (an `ip
    /// netns` name; `ip netns exec` gives it that namespace's /sys too, as a container has),
    /// observing the lab's node with `--node-netns` (the namespace file's path), `extra`
    /// after (the listeners, which bind in `pod`).
    pub fn start_in_pod(lab: &Lab, pod: &str, extra: &[&str]) -> Self {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", pod])
            .arg(observer_bin())
            .arg("agent")
            .arg("--node-netns")
            .arg(lab.ns_path("node"));
        Self::spawn(lab, cmd, extra)
    }

    fn spawn(lab: &Lab, mut cmd: Command, extra: &[&str]) -> Self {
        let dir = std::env::temp_dir().join(format!("{}-agent", lab.prefix));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("agent.sock");
        let ready = dir.join("ready");
        let _ = std::fs::remove_file(&ready);
        let child = cmd
            .arg("--socket")
            .arg(&socket)
            .arg("--ready-file")
            .arg(&ready)
            .args(["--node-name", "lab-node", "--idle-ms", "1000"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn observer agent");
        let mut child = child;
        let mut e = child.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = e.read_to_end(&mut b);
            b
        });
        let mut agent = Self {
            child: Some(child),
            socket,
            ready,
            err: Some(err),
        };
        let deadline = Instant::now() + Duration::from_secs(60) * crate::time_scale();
        while !agent.ready.exists() {
            if let Some(status) = agent.child.as_mut().unwrap().try_wait().unwrap() {
                agent.child = None;
                let err = agent.stderr();
                panic!("observer agent exited before ready ({status}): {err}");
            }
            assert!(
                Instant::now() < deadline,
                "observer agent not ready in {} s",
                60 * crate::time_scale()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        agent
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends `signal` and waits for the exit; returns (status, stderr, time to exit).
    pub fn stop(mut self, signal: &str) -> (std::process::ExitStatus, String, Duration) {
        let mut child = self.child.take().unwrap();
        let t = Instant::now();
        crate::run(&["kill", &format!("-{signal}"), &child.id().to_string()]);
        let status = child.wait().expect("agent exits");
        let took = t.elapsed();
        (status, self.stderr(), took)
    }

    /// What the agent wrote to stderr, once it has exited.
    fn stderr(&mut self) -> String {
        self.err
            .take()
            .map(|h| String::from_utf8_lossy(&h.join().unwrap_or_default()).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        // A failed test shows what the agent said: the cause is often there.
        if std::thread::panicking() {
            eprintln!("observer agent's stderr:\n{}", self.stderr());
        }
    }
}

/// HTTP from namespace `ns` as `uid` (`setpriv`, no other privilege; with `/usr/bin/python3`):
/// each request (`METHOD HOST:PORT PATH`) with what came back:
/// `refused` (nothing listens there), `error ...`, or the status; and the body (at most
/// 1 MiB of it).
pub fn http_as(ns: &str, uid: u32, reqs: &[&str]) -> Vec<(String, String, String)> {
    let script = r#"
import http.client, json, sys
for req in sys.argv[1:]:
    method, addr, path = req.split(" ")
    host, port = addr.rsplit(":", 1)
    body = ""
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=30)
        c.request(method, path)
        r = c.getresponse()
        body = r.read(1 << 20).decode(errors="replace")
        answer = str(r.status)
        c.close()
    except ConnectionRefusedError:
        answer = "refused"
    except Exception as e:
        answer = "error %r" % e
    print(req, answer, json.dumps(body), sep="\t")
"#;
    let id = uid.to_string();
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "setpriv"])
        .args(["--reuid", &id, "--regid", &id, "--clear-groups"])
        .args(["/usr/bin/python3", "-c", script])
        .args(reqs)
        .output()
        .expect("run setpriv python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.splitn(3, '\t').collect();
            let body: String = serde_json::from_str(f.get(2).unwrap_or(&"\"\"")).unwrap();
            (f[0].to_string(), f.get(1).unwrap_or(&"").to_string(), body)
        })
        .collect()
}

/// The agent pod's network namespace, as a pod without hostNetwork has one: `name`, joined
/// to the namespace `node` by a veth (`obsapi0` there, `eth0` in the pod) on
/// 100.64.`net`.0/30, the pod at .2 ([`PodNetns::ip`]) and the node's end at .1. Deleted on
/// drop, even when a test panics.
pub struct PodNetns {
    pub name: String,
    pub ip: String,
}

impl PodNetns {
    pub fn new(node: &str, name: &str, net: u8) -> Self {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        crate::run(&["ip", "netns", "add", name]);
        let me = Self {
            name: name.to_string(),
            ip: format!("100.64.{net}.2"),
        };
        let (n, p) = (node, name);
        let (node_end, pod_end) = (format!("100.64.{net}.1/30"), format!("{}/30", me.ip));
        for c in [
            vec!["-n", p, "link", "set", "lo", "up"],
            vec![
                "link", "add", "obsapi0", "netns", n, "type", "veth", "peer", "name", "eth0",
                "netns", p,
            ],
            vec!["-n", n, "addr", "add", &node_end, "dev", "obsapi0"],
            vec!["-n", n, "link", "set", "obsapi0", "up"],
            vec!["-n", p, "addr", "add", &pod_end, "dev", "eth0"],
            vec!["-n", p, "link", "set", "eth0", "up"],
        ] {
            let mut args = vec!["ip"];
            args.extend(c);
            crate::run(&args);
        }
        me
    }
}

impl Drop for PodNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// The agent's metrics (`GET /metrics` on [`METRICS`]), which must answer 200.
pub fn scrape(lab: &Lab) -> String {
    let (status, body) = http_get(lab, METRICS, "/metrics");
    assert_eq!(status, 200, "{body}");
    body
}

/// `GET path` on `addr` from inside the lab's node namespace: (status, body).
pub fn http_get(lab: &Lab, addr: &'static str, path: &str) -> (u16, String) {
    try_http_get(lab, addr, path).unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"))
}

/// As [`http_get`], with the error (nothing listens yet, ...).
pub fn try_http_get(
    lab: &Lab,
    addr: &'static str,
    path: &str,
) -> Result<(u16, String), std::io::Error> {
    get_with(lab, addr, path, "").map(|(status, _, body)| (status, body))
}

/// `GET path` with `accept` as its `Accept` header: (status, response head, body).
pub fn http_get_accept(
    lab: &Lab,
    addr: &'static str,
    path: &str,
    accept: &str,
) -> (u16, String, String) {
    get_with(lab, addr, path, &format!("Accept: {accept}\r\n"))
        .unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"))
}

fn get_with(
    lab: &Lab,
    addr: &'static str,
    path: &str,
    headers: &str,
) -> Result<(u16, String, String), std::io::Error> {
    let (path, headers) = (path.to_string(), headers.to_string());
    lab.run_in("node", move || {
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n"
        )?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf)?;
        Ok(response(&buf))
    })
}

/// An HTTP/1.1 response as read whole: (status, 0 when there is none; head; body).
fn response(buf: &[u8]) -> (u16, String, String) {
    let text = String::from_utf8_lossy(buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

/// Waits (up to 20 s) until the agent says it records traversals (`observer_tracing` 1),
/// as it does once a streaming client is connected; `what` names the case on failure.
pub fn wait_until_tracing(lab: &Lab, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = http_get(lab, METRICS, "/metrics");
        if status == 200 && sample(&body, "observer_tracing", &[]) == 1.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the agent did not start tracing for its client: {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Percent-encodes a query parameter.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The value of `name`'s series with `labels` in a scrape (the sum when several match).
/// An absent series fails the test, naming the metric and the series of that name the
/// scrape does have: a metric renamed or no longer made must never read as 0.
pub fn sample(scrape: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    try_sample(scrape, name, labels).unwrap_or_else(|| {
        let present: Vec<&str> = series_lines(scrape, name, &[]).collect();
        panic!(
            "the metric {name}{} is absent from the scrape (series of {name} present: {present:#?})",
            show_labels(labels)
        )
    })
}

/// As [`sample`], `None` when no series matches: for waiting until a series appears (a
/// counter's series open at its first count), never for a check that it stays 0.
pub fn try_sample(scrape: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for l in series_lines(scrape, name, labels) {
        let v = l
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name}: a sample line without a number: {l}"));
        *found.get_or_insert(0.0) += v;
    }
    found
}

/// A count taken *before* the traffic a test then counts: 0 when the counter's series has
/// not been opened yet (the agent opens a counter's series at its first count). The count
/// after the traffic must be read with [`sample`], which fails on an absent series.
pub fn baseline(scrape: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    try_sample(scrape, name, labels).unwrap_or(0.0)
}

/// Every series of `name` with `labels`, as its line (value included), in scrape order.
pub fn series_lines<'a>(
    scrape: &'a str,
    name: &'a str,
    labels: &'a [(&'a str, &'a str)],
) -> impl Iterator<Item = &'a str> + 'a {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(move |l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(move |l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
}

fn show_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    format!("{{{}}}", l.join(","))
}

/// `observer tail --agent` (or `drops --agent`) as a child; its output read as it comes.
pub struct Client {
    child: Child,
    out: Printed,
    err: std::thread::JoinHandle<Vec<u8>>,
}

impl Client {
    pub fn start(args: &[&str]) -> Self {
        Self::start_cmd(Command::new(observer_bin()).args(args))
    }

    /// Any command, read the same way.
    pub fn start_cmd(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn observer client");
        let out = Printed::read(child.stdout.take().unwrap());
        let mut e = child.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut b = Vec::new();
            let _ = e.read_to_end(&mut b);
            b
        });
        Self { child, out, err }
    }

    /// Waits (within `within`) until `n` whole stdout lines satisfy `pred`.
    pub fn wait_for(&self, what: &str, within: Duration, n: usize, pred: impl Fn(&str) -> bool) {
        self.out.wait_for(what, within, n, pred);
    }

    /// Waits for the exit (within `within`); returns (stdout lines, stderr).
    pub fn finish(mut self, within: Duration) -> (Vec<String>, String) {
        let deadline = Instant::now() + within;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "client did not finish within {within:?}: {}",
                    String::from_utf8_lossy(&self.err.join().unwrap())
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let stdout = self.out.finish();
        let stderr = String::from_utf8_lossy(&self.err.join().unwrap()).into_owned();
        assert!(status.success(), "client failed ({status}): {stderr}");
        (
            String::from_utf8_lossy(&stdout)
                .lines()
                .map(str::to_string)
                .collect(),
            stderr,
        )
    }
}

/// One request on the agent's unix socket, raw: (status, body), read within 10 s.
pub fn unix_request(socket: &std::path::Path, method: &str, target: &str) -> (u16, String) {
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let length = if method == "POST" {
        "Content-Length: 0\r\n"
    } else {
        ""
    };
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: agent\r\n{length}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let (status, _, body) = response(&buf);
    (status, body)
}

/// `GET path` on the agent's unix socket: the body (the answer must be 200).
pub fn unix_get(socket: &std::path::Path, path: &str) -> String {
    let (status, body) = unix_request(socket, "GET", path);
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "# TYPE observer_drops_total counter\n\
        observer_drops_total{node=\"n\",hook=\"FORWARD\",table=\"filter\"} 3\n\
        observer_drops_total{node=\"n\",hook=\"INPUT\",table=\"filter\"} 2\n\
        observer_drops_totalx{node=\"n\"} 9\n\
        observer_tracing{node=\"n\"} 0\n";

    #[test]
    fn a_present_series_is_read_and_summed() {
        assert_eq!(sample(SCRAPE, "observer_tracing", &[]), 0.0);
        assert_eq!(
            sample(SCRAPE, "observer_drops_total", &[("hook", "FORWARD")]),
            3.0
        );
        assert_eq!(sample(SCRAPE, "observer_drops_total", &[]), 5.0);
        assert_eq!(
            baseline(SCRAPE, "observer_drops_total", &[("hook", "OUTPUT")]),
            0.0
        );
        assert_eq!(try_sample(SCRAPE, "observer_drops", &[]), None);
    }

    #[test]
    #[should_panic(expected = "the metric observer_drops_total{hook=\"OUTPUT\"} is absent")]
    fn an_absent_series_fails_naming_the_metric() {
        sample(SCRAPE, "observer_drops_total", &[("hook", "OUTPUT")]);
    }

    #[test]
    #[should_panic(expected = "the metric observer_subscribers is absent")]
    fn an_absent_metric_fails() {
        sample(SCRAPE, "observer_subscribers", &[]);
    }
}
