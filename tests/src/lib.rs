//! Shared harness for the privileged integration tests: namespaces that remove themselves,
//! running code inside a namespace, and the skip policy (loud skip locally, failure under CI).

pub mod agent;
pub mod bpf;
pub mod lab;
pub mod nft_shapes;
pub mod printed;
pub mod raw;
pub mod rules;
pub mod wire;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// True when a privileged test must run, never skip: under CI (`CI=true`), and under
/// `cargo xtask test` (`OBSERVER_NO_SKIP=1`, unless it was given `--allow-skips`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
        || std::env::var("OBSERVER_NO_SKIP").is_ok_and(|v| v == "1")
}

/// Returns true when the privileged test can run. Outside CI, a machine without root, BTF or
/// `ip` prints a loud skip message and returns false; under CI it panics instead.
pub fn privileged(test: &str) -> bool {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root (run as root)");
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        missing.push("kernel BTF (/sys/kernel/btf/vmlinux)");
    }
    if Command::new("ip").arg("-V").output().is_err() {
        missing.push("iproute2 (`cargo xtask setup` installs it)");
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{test}: needs {}", missing.join(", "));
    if in_ci() {
        panic!(
            "{msg}; under CI or `cargo xtask test` a privileged test fails instead of skipping \
             (`cargo xtask test --allow-skips` lets it skip, loudly)"
        );
    }
    eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    false
}

/// Runs a command and returns its output; panics with stderr if it fails.
pub fn run(args: &[&str]) -> Output {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs a shell snippet with `sh -ec`; panics with its output if it fails.
pub fn sh(script: &str) -> String {
    String::from_utf8(run(&["sh", "-ec", script]).stdout).expect("utf-8 output")
}

/// A unique prefix for namespace and interface names (short: interface names are <= 15 bytes).
pub fn unique_prefix(tag: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{tag}{}{n}", std::process::id() % 10000)
}

/// A network namespace created with `ip netns add` and deleted on drop, even when a test panics.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(name: &str) -> Self {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        run(&["ip", "netns", "add", name]);
        let ns = Self {
            name: name.to_string(),
        };
        ns.exec(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    /// Runs a command inside the namespace (`ip netns exec`), panicking if it fails.
    pub fn exec(&self, args: &[&str]) -> Output {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        run(&full)
    }

    /// Runs a shell snippet inside the namespace.
    pub fn sh(&self, script: &str) -> String {
        String::from_utf8(self.exec(&["sh", "-ec", script]).stdout).expect("utf-8 output")
    }

    /// Path of the namespace's bind mount.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `f` on a fresh thread that has joined this namespace, and returns its result.
    /// Sockets opened by `f` live in the namespace.
    pub fn run<F, R>(&self, f: F) -> R
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let path = self.path();
        std::thread::spawn(move || {
            enter_netns(&path);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Moves the calling thread into the namespace at `path`.
pub fn enter_netns(path: &std::path::Path) {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    // SAFETY: setns on a valid namespace fd only affects the calling thread.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "setns {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// Joins two namespaces with a veth pair `a_if` (in `a`) <-> `b_if` (in `b`), both up.
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) {
    run(&[
        "ip", "link", "add", a_if, "netns", &a.name, "type", "veth", "peer", "name", b_if, "netns",
        &b.name,
    ]);
    a.exec(&["ip", "link", "set", a_if, "up"]);
    b.exec(&["ip", "link", "set", b_if, "up"]);
}

/// Runs `cmd` inside namespace `ns` with `input` on stdin: Ok, or Err with its whole stderr
/// (callers keep the part that answers them).
pub fn run_in_with_stdin(ns: &Netns, cmd: &[&str], input: &str) -> Result<(), String> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.name])
        .args(cmd)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    // A failing restore may exit before reading everything; a broken pipe is its answer.
    let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// How much slower than hardware this machine runs: `OBSERVER_TIME_SCALE` (the kernel
/// matrix's guests run under QEMU's software emulation), else 1. Waits scale by it; the
/// tight figures live in the bench, not in tests.
pub fn time_scale() -> u32 {
    std::env::var("OBSERVER_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(1)
}

/// Polls `f` every 100 ms until it is true; panics naming `what` after `within` (times
/// [`time_scale`]).
pub fn wait_for(what: &str, within: std::time::Duration, mut f: impl FnMut() -> bool) {
    let within = within * time_scale();
    let deadline = std::time::Instant::now() + within;
    while !f() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out ({within:?}) waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
