//! Developer tasks. Every task that needs the toolchain runs `setup` first, which is
//! idempotent and quick when everything is already installed.
//!
//! - `setup`: Debian packages, the nightly toolchain with rust-src, bpf-linker built against
//!   that toolchain's own LLVM.
//! - `build`: release binary at target/release/observer with the probes embedded.
//! - `demo`: the main job on the built-in lab: build, lab up, trace a few flows, lab down.
//! - `test`: fmt, clippy, and every test (unit and privileged integration tests).
//! - `image`: the agent's container image (Containerfile), built with buildah.
//! - `bench`: iperf3 through the lab node with and without the observer, and the rules bench;
//!   `bench --soak`: the agent's memory and descriptors over a long run of churn (`soak.rs`).
//! - `golden`: record the lab's demo flows again for the golden replay tests, or (with
//!   `--outputs-only`) rewrite their expected outputs from the checked-in recordings.
//! - `fuzz`: every fuzz target in `fuzz/` for a bounded time each (nightly, cargo-fuzz);
//!   an input that crashes one is kept in `fuzz/regressions/`, which the normal tests run.
//! - `vm`: boot Debian's 6.1 or 6.12 kernel (or both) under QEMU and run a command in it
//!   (`vm.rs`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod matrix;
mod soak;
mod vm;

/// Nightly installed when the machine has none: its LLVM major must match bpf-linker's.
const PINNED_NIGHTLY: &str = "nightly-2026-05-19";
const BPF_LINKER_VERSION: &str = "0.13.0";
const CARGO_FUZZ_VERSION: &str = "0.13.2";
/// Seconds per fuzz target in `cargo xtask test`: six targets, about a minute and a half
/// of fuzzing (plus the fuzz build, incremental after the first) on every run.
const FUZZ_SECONDS_IN_TEST: u32 = 15;
/// The fuzz targets (`fuzz/fuzz_targets/`) and the seed directories each starts from.
const FUZZ_TARGETS: &[(&str, &[&str])] = &[
    ("parse_iptables_save", &["seeds"]),
    ("parse_nft_json", &["seeds-nft"]),
    ("filter_parser", &["seeds-filter"]),
    ("recording_decoder", &["seeds-recording"]),
    ("routes_and_marks", &["seeds-routes"]),
    ("agent_line_reader", &["seeds-lines"]),
];
const PACKAGES: &[&str] = &[
    "iptables",
    "nftables",
    "ipset",
    "conntrack",
    "iproute2",
    "iperf3",
    "procps",
    "kmod",
    // The IPVS lab loads its virtual services with ipvsadm-restore; explain --live reads them.
    "ipvsadm",
    // The agent's tests list the BPF programs and links the agent holds.
    "bpftool",
    // Reads back `tail --pcapng` files in the tests.
    "tshark",
    // The agent's tests: a real Prometheus scrapes it, promtool lints its metrics.
    "prometheus",
    // `cargo xtask image` and its test: build the image (no registry), run it with runc.
    "buildah",
    "podman",
    "runc",
    // kubernetes-validate (PyPI) lives in a venv; the image test reads the DaemonSet.
    "python3-venv",
    "python3-yaml",
    // musl-gcc: C code in the agent's dependencies (ring, for the API server's TLS) built for
    // the static musl binary.
    "musl-tools",
    // `cargo xtask vm`: QEMU, the guest's initramfs (busybox), the kernels' decompressors.
    "qemu-system-x86",
    "busybox-static",
    "xz-utils",
    "zstd",
];

/// kubernetes-validate, from PyPI into a venv of its own (validates the manifests offline
/// against the Kubernetes 1.37 schemas it ships).
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";
/// The image `cargo xtask image` builds and the image test runs.
const IMAGE: &str = "localhost/observer:latest";

#[derive(Parser)]
#[command(name = "cargo xtask", about = "observer's developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what the build and the tests need (idempotent; run as root).
    Setup,
    /// Build the release binary (target/release/observer) with its probes.
    Build,
    /// Build the release binary and install it as PREFIX/bin/observer, with the symlink
    /// PREFIX/bin/kubectl-observer that makes it the kubectl plugin (`kubectl observer`).
    Install {
        /// Where to install (bin/ under it must be on PATH); default ~/.local.
        #[arg(long, value_name = "DIR")]
        prefix: Option<PathBuf>,
    },
    /// Build, bring up the netns lab, trace demo flows through it, tear it down.
    Demo {
        /// kube-proxy's mode on the lab node: iptables (KUBE-* chains) or nftables (native
        /// `kube-proxy` tables; the demo also prints `observer explain --live` for a flow), or
        /// bridge (pods on the bridge cni0 with br_netfilter, the bridge lab's flows).
        #[arg(long, default_value = "iptables", value_parser = ["iptables", "nftables", "bridge"])]
        mode: String,
    },
    /// Formatting, clippy, unit tests and privileged integration tests.
    Test {
        /// Let privileged tests skip (loudly) where root, BTF or a tool is missing, instead
        /// of failing: without it, a test that cannot run fails and names what it needs.
        #[arg(long)]
        allow_skips: bool,
        /// Leave out the kernel matrix (the privileged tests in QEMU guests of Debian's 6.1
        /// and 6.12 kernels, after the host's suite): for a quick local run only; CI runs it.
        #[arg(long)]
        no_kernel_matrix: bool,
        /// Seconds each fuzz target runs after the tests (from its seeds and the corpus
        /// kept in fuzz/corpus); 0 leaves the fuzz run out (loudly), for a quick local run.
        #[arg(long, default_value_t = FUZZ_SECONDS_IN_TEST)]
        fuzz_seconds: u32,
        /// Extra arguments for `cargo test` (after `--`), e.g. a test name filter.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Only the kernel matrix (the part of `test` that runs in QEMU guests of Debian's
    /// kernels): builds, then runs each kernel's tests in its guest.
    Matrix,
    /// Golden replay files (observer/tests/golden): record the lab's demo flows with
    /// `tail --record` (root) and write what `observer replay` prints of them.
    Golden {
        /// Keep the recordings; only rewrite the expected outputs by replaying them (no
        /// root; after an intended change of the reports: review the diff).
        #[arg(long)]
        outputs_only: bool,
    },
    /// The agent's container image (Containerfile): a static observer (musl) with the
    /// iptables/nftables/ipset tools from this machine's Debian packages; built with
    /// buildah, no registry pull.
    Image,
    /// Fuzz every target in fuzz/ for a bounded time each (nightly and cargo-fuzz are
    /// installed if missing; `test` runs it for --fuzz-seconds each). An input that crashes
    /// a target is copied to fuzz/regressions/<target>/, which `cargo test -p observer
    /// --test fuzz_regressions` replays on every run.
    Fuzz {
        /// Seconds per target.
        #[arg(long, default_value_t = 60)]
        seconds: u32,
        /// Only these targets (default: all).
        targets: Vec<String>,
    },
    /// Benchmarks: iperf3 through the lab with and without the observer; ruleset parsing.
    Bench {
        /// Seconds per iperf3 run.
        #[arg(long, default_value_t = 2)]
        seconds: u32,
        /// Runs of each workload per phase and round, TCP and UDP taking turns; the
        /// phase's rate in that round is their median (a dip of the VM's speed lasting a
        /// few seconds then moves one run, not the round).
        #[arg(long, default_value_t = 3)]
        runs: u32,
        /// Alternating rounds of every phase, every other one backwards, with a baseline
        /// before the first phase and after each (medians are printed); this VM's rates
        /// move by up to a tenth between runs, so fewer than 7 say
        /// little about a margin of a few hundredths.
        #[arg(long, default_value_t = 7)]
        rounds: u32,
        /// Only the agent reading a generated 5,000-service (40,000-rule) ruleset: its CPU
        /// and resident memory over a minute of reads at the default interval.
        #[arg(long)]
        rules_read_only: bool,
        /// Only the agent's rows (issue 20): no agent against the agent's default mode,
        /// under TCP, 64-byte UDP and a drop flood, then its CPU and memory reading a
        /// 5,000-service ruleset; no collector, model or tail phases (about 15 minutes
        /// with the defaults on a quiet machine).
        #[arg(long, conflicts_with = "rules_read_only")]
        agent: bool,
        /// Measure target/release/observer as it is: no build first (e.g. to measure
        /// a binary built before a change).
        #[arg(long)]
        no_build: bool,
        /// Only the soak (issue 33): the agent in its default mode for `--minutes` under
        /// UDP, `tail --agent` sessions, veth and FORWARD-rule churn, its RSS and open
        /// descriptors sampled; the troughs' slope, the peak and the descriptors judged.
        #[arg(long, conflicts_with_all = ["rules_read_only", "agent"])]
        soak: bool,
        /// The soak's length.
        #[arg(long, default_value_t = 30, requires = "soak")]
        minutes: u32,
    },
    /// Boot Debian's 6.1 or 6.12 kernel (or both side by side) under QEMU (software
    /// emulation) and run a command in it as root, in this directory, on a copy-on-write view
    /// of this machine's root (writes stay in the guest); exits with the command's status.
    /// Kernels are downloaded (never installed) and cached in /var/cache/observer-vm
    /// ($OBSERVER_VM_CACHE).
    Vm {
        /// Debian 12's newest plain amd64 kernel of this series, or both side by side.
        #[arg(long, default_value = "6.12", value_parser = ["6.1", "6.12", "all"])]
        kernel: String,
        /// Guest CPUs (default 2, or 1 each with `--kernel all`).
        #[arg(long)]
        cpus: Option<u32>,
        /// Guest memory in MiB.
        #[arg(long, default_value_t = 1024)]
        memory: u32,
        /// Kill the guest and fail after this many seconds.
        #[arg(long, default_value_t = 1800)]
        timeout: u64,
        /// Pass this host environment variable to the command (repeatable; CI always is
        /// when set).
        #[arg(long = "env", value_name = "NAME")]
        env: Vec<String>,
        /// A host directory the guest may write, at the same path (everything else it
        /// writes stays in the guest).
        #[arg(long, value_name = "DIR")]
        share: Option<std::path::PathBuf>,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Sends 64-byte UDP datagrams to ADDR as fast as one thread can for SECONDS and prints
    /// how many it sent (the bench's drop flood; run inside a lab namespace).
    #[command(hide = true)]
    Flood {
        addr: std::net::SocketAddr,
        seconds: f64,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let caller_dir = std::env::current_dir()?;
    let root = workspace_root();
    std::env::set_current_dir(&root)?;
    match cli.task {
        Task::Setup => setup().map(|_| ()),
        Task::Build => {
            let tc = setup()?;
            build(&tc, true)
        }
        Task::Install { prefix } => {
            let tc = setup()?;
            build(&tc, true)?;
            install(
                &observer_bin(true),
                &prefix.unwrap_or_else(|| home().join(".local")),
            )
        }
        Task::Demo { mode } => demo(&mode),
        Task::Image => {
            let tc = setup()?;
            image(&tc)
        }
        Task::Test {
            allow_skips,
            no_kernel_matrix,
            fuzz_seconds,
            args,
        } => test(&args, allow_skips, !no_kernel_matrix, fuzz_seconds),
        Task::Matrix => {
            let tc = setup()?;
            build(&tc, false)?;
            matrix::run(&tc, &observer_bin(false))
        }
        Task::Golden { outputs_only } => golden(outputs_only),
        Task::Bench {
            seconds,
            runs,
            rounds,
            rules_read_only,
            agent,
            no_build,
            soak,
            minutes,
        } => {
            if soak {
                return in_lab("bench", "obsoak", "iptables", !no_build, |bin| {
                    soak::soak(bin, minutes)
                });
            }
            if !rules_read_only {
                bench(seconds, runs, rounds, agent, no_build)?;
            }
            let tc = setup()?;
            if !no_build {
                build(&tc, true)?;
            }
            need_root("bench")?;
            bench_rules_read(&observer_bin(true))
        }
        Task::Fuzz { seconds, targets } => fuzz(seconds, &targets, false),
        Task::Flood { addr, seconds } => flood(addr, seconds),
        Task::Vm {
            kernel,
            cpus,
            memory,
            timeout,
            env,
            share,
            command,
        } => {
            let task = vm::VmTask {
                which: &kernel,
                cpus,
                memory_mib: memory,
                timeout_secs: timeout,
                env_names: &env,
                share,
                cwd: caller_dir,
            };
            let code = vm::vm_task(task, &command)?;
            std::process::exit(code)
        }
    }
}

fn golden(outputs_only: bool) -> Result<()> {
    if outputs_only {
        return run(Command::new("cargo")
            .args([
                "test",
                "--locked",
                "-p",
                "observer",
                "--test",
                "replay_golden",
            ])
            .env("OBSERVER_SKIP_EBPF", "1")
            .env("OBSERVER_UPDATE_GOLDEN", "1"));
    }
    need_root("golden")?;
    let tc = setup()?;
    build(&tc, false)?;
    run(Command::new("cargo")
        .args([
            "test",
            "--locked",
            "-p",
            "observer-tests",
            "--test",
            "replay",
        ])
        .env("OBSERVER_EBPF_TOOLCHAIN", &tc)
        .env("OBSERVER_BIN", observer_bin(false))
        .env("OBSERVER_UPDATE_GOLDEN", "1")
        .args(["--", "recorded_lab_flows_replay_as_printed_live", "--exact"]))?;
    eprintln!(
        "xtask: golden recordings and outputs rewritten in observer/tests/golden; review and commit them"
    );
    Ok(())
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_ok_and(|s| s.trim() == "0")
}

/// Installs everything; returns the toolchain that builds the probes.
fn setup() -> Result<String> {
    let t0 = Instant::now();
    install_packages()?;
    let tc = nightly_toolchain()?;
    install_bpf_linker(&tc)?;
    install_cargo_fuzz()?;
    install_kubernetes_validate()?;
    eprintln!(
        "xtask: setup complete in {:.1}s (probe toolchain {tc})",
        t0.elapsed().as_secs_f64()
    );
    Ok(tc)
}

fn install_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .is_ok_and(|s| s.contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("Debian packages {missing:?} are missing; run `cargo xtask setup` as root");
    }
    eprintln!("xtask: installing {missing:?}");
    if missing.contains(&"tshark") {
        // wireshark-common asks whether non-root users may capture; answer it beforehand so
        // that the install never waits for a terminal (no: the tests run as root).
        let mut preseed = Command::new("debconf-set-selections")
            .stdin(Stdio::piped())
            .spawn()
            .context("cannot run debconf-set-selections")?;
        std::io::Write::write_all(
            preseed.stdin.as_mut().expect("piped stdin"),
            b"wireshark-common wireshark-common/install-setuid boolean false\n",
        )?;
        drop(preseed.stdin.take());
        if !preseed.wait()?.success() {
            bail!("debconf-set-selections failed to preseed wireshark-common");
        }
    }
    run(Command::new("apt-get").arg("update").arg("-qq"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn rustc_llvm_major(tc: &str) -> Option<String> {
    let v = output(Command::new("rustup").args(["run", tc, "rustc", "-vV"])).ok()?;
    let line = v.lines().find(|l| l.starts_with("LLVM version:"))?;
    Some(
        line.split(':')
            .nth(1)?
            .trim()
            .split('.')
            .next()?
            .to_string(),
    )
}

/// A nightly with rust-src: `OBSERVER_EBPF_TOOLCHAIN`, else the installed `nightly`, else the
/// pinned dated nightly (installed). The floating channel is never updated implicitly.
fn nightly_toolchain() -> Result<String> {
    let tc = if let Ok(tc) = std::env::var("OBSERVER_EBPF_TOOLCHAIN") {
        tc
    } else if rustc_llvm_major("nightly").is_some() {
        "nightly".to_string()
    } else if rustc_llvm_major(PINNED_NIGHTLY).is_some() {
        PINNED_NIGHTLY.to_string()
    } else {
        eprintln!("xtask: installing {PINNED_NIGHTLY}");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            PINNED_NIGHTLY,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]))?;
        PINNED_NIGHTLY.to_string()
    };
    let comps = output(Command::new("rustup").args([
        "component",
        "list",
        "--installed",
        "--toolchain",
        &tc,
    ]))?;
    if !comps.lines().any(|l| l.starts_with("rust-src")) {
        eprintln!("xtask: adding rust-src to {tc}");
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", &tc]))?;
    }
    Ok(tc)
}

/// cargo-fuzz, installed once (`cargo install` with the locked dependency versions).
fn install_cargo_fuzz() -> Result<()> {
    let have = output(Command::new("cargo").args(["fuzz", "--version"]));
    if have.is_ok_and(|v| v.contains(CARGO_FUZZ_VERSION)) {
        return Ok(());
    }
    eprintln!("xtask: installing cargo-fuzz {CARGO_FUZZ_VERSION}");
    run(Command::new("cargo").args([
        "install",
        "--locked",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
    ]))
}

fn fuzz(seconds: u32, only: &[String], quick: bool) -> Result<()> {
    let tc = nightly_toolchain()?;
    install_cargo_fuzz()?;
    let root = workspace_root().join("fuzz");
    if let Some(t) = only
        .iter()
        .find(|t| !FUZZ_TARGETS.iter().any(|(name, _)| name == t))
    {
        bail!(
            "no fuzz target `{t}`; the targets are {:?}",
            FUZZ_TARGETS.iter().map(|(n, _)| *n).collect::<Vec<_>>()
        );
    }
    let mut crashed = Vec::new();
    let mut summary = Vec::new();
    for (target, seeds) in FUZZ_TARGETS {
        if !only.is_empty() && !only.iter().any(|t| t == target) {
            continue;
        }
        let corpus = root.join("corpus").join(target);
        let artifacts = root.join("artifacts").join(target);
        std::fs::create_dir_all(&corpus)?;
        std::fs::create_dir_all(&artifacts)?;
        let before = dir_files(&artifacts);
        let t0 = Instant::now();
        let mut fuzz_cmd = Command::new("cargo");
        fuzz_cmd
            .arg(format!("+{tc}"))
            .args(["fuzz", "run", target])
            .args(if quick {
                &["--dev", "--sanitizer", "none"][..]
            } else {
                &[]
            })
            .arg(&corpus)
            .args(seeds.iter().map(|s| root.join(s)))
            .arg("--")
            .arg(format!("-max_total_time={seconds}"))
            .args(["-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1"])
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .current_dir(&root)
            // The probes are not fuzzed: the observer crate builds without them.
            .env("OBSERVER_SKIP_EBPF", "1");
        // What `cargo xtask` (stable) put in this process's environment is not for the
        // nightly build: left in, it makes cargo-fuzz rebuild everything.
        for key in [
            "CARGO",
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_TARGET_DIR",
            "RUSTC",
            "RUSTC_WRAPPER",
            "RUSTC_WORKSPACE_WRAPPER",
            "RUSTFLAGS",
            "RUSTUP_TOOLCHAIN",
        ] {
            fuzz_cmd.env_remove(key);
        }
        let status = fuzz_cmd.status().context("cannot run cargo fuzz")?;
        let new: Vec<PathBuf> = dir_files(&artifacts)
            .into_iter()
            .filter(|f| !before.contains(f))
            .collect();
        // Every input that crashed the target becomes a regression test.
        let keep = root.join("regressions").join(target);
        for f in &new {
            std::fs::create_dir_all(&keep)?;
            let name = f.file_name().expect("a file").to_owned();
            std::fs::copy(f, keep.join(&name))?;
            crashed.push(format!("{target}: {}", keep.join(name).display()));
        }
        summary.push(format!(
            "  {target:<22} {:>5.0} s  {}  corpus {} inputs",
            t0.elapsed().as_secs_f64(),
            if status.success() && new.is_empty() {
                "ok".to_string()
            } else {
                format!("FAILED ({status}, {} new crashing inputs)", new.len())
            },
            dir_files(&corpus).len()
        ));
    }
    println!("xtask fuzz, {seconds} s per target:");
    for l in &summary {
        println!("{l}");
    }
    if !crashed.is_empty() {
        bail!(
            "inputs crashed fuzz targets; each is now a regression test (`cargo test -p \
             observer --test fuzz_regressions`): fix the code, then commit them:\n  {}",
            crashed.join("\n  ")
        );
    }
    if summary.iter().any(|l| l.contains("FAILED")) {
        bail!("a fuzz target failed without a crashing input (see its output above)");
    }
    Ok(())
}

fn dir_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default()
}

fn home() -> PathBuf {
    PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
}

/// bpf-linker links libLLVM dynamically; it must use the same LLVM major as the nightly.
/// No system LLVM of that version exists, so it is built against the toolchain's own
/// libLLVM, through a stable prefix directory (the binary keeps an rpath into it).
fn install_bpf_linker(tc: &str) -> Result<()> {
    let major = rustc_llvm_major(tc).context("cannot read the nightly's LLVM version")?;
    let sysroot = output(Command::new("rustup").args(["run", tc, "rustc", "--print", "sysroot"]))?;
    let sysroot = PathBuf::from(sysroot.trim());
    let prefix = home().join(".cache/observer").join(format!("llvm-{major}"));
    let stamp = prefix.join("stamp");
    let want = format!(
        "bpf-linker {BPF_LINKER_VERSION} llvm-{major} {}\n",
        sysroot.display()
    );
    let linker = home().join(".cargo/bin/bpf-linker");
    if linker.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(());
    }
    let lib = prefix.join("lib");
    std::fs::create_dir_all(&lib)?;
    let so = std::fs::read_dir(sysroot.join("lib"))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so.") || (n.starts_with("libLLVM-") && n.ends_with(".so")))
        .context("the nightly toolchain ships no libLLVM")?;
    for name in ["libLLVM.so".to_string(), so.clone()] {
        let link = lib.join(&name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(sysroot.join("lib").join(&so), &link)?;
    }
    eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against {so} (about a minute)");
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--locked",
            "--force",
            "--version",
            BPF_LINKER_VERSION,
        ])
        .args([
            "--no-default-features",
            "--features",
            &format!("llvm-{major}"),
        ])
        .env("LLVM_PREFIX", &prefix))?;
    std::fs::write(&stamp, want)?;
    Ok(())
}

fn kubernetes_validate_bin() -> PathBuf {
    home().join(".cache/observer/venv/bin/kubernetes-validate")
}

/// kubernetes-validate in `~/.cache/observer/venv` (idempotent).
fn install_kubernetes_validate() -> Result<()> {
    let venv = home().join(".cache/observer/venv");
    let stamp = venv.join("observer-stamp");
    if kubernetes_validate_bin().exists()
        && std::fs::read_to_string(&stamp).is_ok_and(|s| s == KUBERNETES_VALIDATE)
    {
        return Ok(());
    }
    eprintln!(
        "xtask: installing {KUBERNETES_VALIDATE} into {}",
        venv.display()
    );
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))
        .context("creating a Python venv (Debian package python3-venv)")?;
    run(Command::new(venv.join("bin/pip")).args(["install", "-q", KUBERNETES_VALIDATE]))?;
    std::fs::write(&stamp, KUBERNETES_VALIDATE)?;
    Ok(())
}

const MUSL: &str = "x86_64-unknown-linux-musl";

/// Tools the agent reads rules with, as the Debian packages installed them: binaries and
/// symlinks (copied with the shared libraries they load).
const IMAGE_TOOLS: &[&str] = &[
    "/usr/sbin/xtables-nft-multi",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/nft",
    "/usr/sbin/ipset",
];

/// `cargo xtask image`: the rootfs under target/image, then `buildah bud` with the
/// Containerfile. Every step is cached: the musl build is incremental and buildah keeps the
/// layer while the rootfs is unchanged.
fn image(tc: &str) -> Result<()> {
    let t0 = Instant::now();
    run(Command::new("rustup").args(["target", "add", MUSL]))?;
    run(Command::new("nice")
        .args([
            "-n",
            "19",
            "cargo",
            "build",
            "--locked",
            "--release",
            "-p",
            "observer",
        ])
        .args(["--target", MUSL])
        .env("CC_x86_64_unknown_linux_musl", "musl-gcc")
        .env("OBSERVER_EBPF_TOOLCHAIN", tc))?;
    let root = workspace_root();
    let ctx = root.join("target/image");
    let rootfs = ctx.join("rootfs");
    let _ = std::fs::remove_dir_all(&rootfs);
    std::fs::create_dir_all(rootfs.join("usr/bin"))?;
    std::fs::copy(
        root.join("target").join(MUSL).join("release/observer"),
        rootfs.join("usr/bin/observer"),
    )?;
    let mut files: Vec<PathBuf> = IMAGE_TOOLS.iter().map(PathBuf::from).collect();
    // iptables-save loads its match and target extensions at run time.
    let xt = Path::new("/usr/lib/x86_64-linux-gnu/xtables");
    for e in std::fs::read_dir(xt).with_context(|| format!("reading {}", xt.display()))? {
        files.push(e?.path());
    }
    let mut libs = std::collections::BTreeSet::new();
    for f in &files {
        let out = output(Command::new("ldd").arg(f)).unwrap_or_default();
        for l in out.lines() {
            // "libx.so.1 => /lib/x86_64-linux-gnu/libx.so.1 (0x...)" or "/lib64/ld-linux... (0x...)"
            let path = l
                .split("=>")
                .last()
                .and_then(|r| r.split_whitespace().next())
                .filter(|p| p.starts_with('/'));
            if let Some(p) = path {
                libs.insert(PathBuf::from(p));
            }
        }
    }
    for f in files.iter().chain(libs.iter()) {
        copy_into(&rootfs, f)?;
    }
    for f in ["/etc/protocols", "/etc/services", "/etc/ethertypes"] {
        if Path::new(f).exists() {
            copy_into(&rootfs, Path::new(f))?;
        }
    }
    // The names iptables and nft are called by, without Debian's alternatives.
    for name in [
        "iptables",
        "iptables-save",
        "ip6tables",
        "ip6tables-save",
        "iptables-nft",
        "iptables-nft-save",
        "ip6tables-nft-save",
    ] {
        std::os::unix::fs::symlink("xtables-nft-multi", rootfs.join("usr/sbin").join(name))?;
    }
    for name in ["iptables-legacy-save", "ip6tables-legacy-save"] {
        std::os::unix::fs::symlink("xtables-legacy-multi", rootfs.join("usr/sbin").join(name))?;
    }
    for dir in ["run", "tmp", "proc", "sys", "dev", "etc"] {
        std::fs::create_dir_all(rootfs.join(dir))?;
    }
    run(Command::new("nice")
        .args(["-n", "19", "buildah", "bud", "--layers", "--quiet"])
        .arg("-f")
        .arg(root.join("Containerfile"))
        .args(["-t", IMAGE])
        .arg(&ctx))?;
    eprintln!(
        "xtask: image {IMAGE} built in {:.0}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Copies `file` (following symlinks) to the same path under `rootfs`.
fn copy_into(rootfs: &Path, file: &Path) -> Result<()> {
    let dest = rootfs.join(file.strip_prefix("/").unwrap_or(file));
    if let Some(d) = dest.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::copy(file, &dest).with_context(|| format!("copying {}", file.display()))?;
    Ok(())
}

fn build(tc: &str, release: bool) -> Result<()> {
    let mut cmd = Command::new("cargo");
    cmd.args(["build", "--locked", "-p", "observer"])
        .env("OBSERVER_EBPF_TOOLCHAIN", tc);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)
}

/// Copies `bin` to PREFIX/bin/observer and points PREFIX/bin/kubectl-observer at it
/// (kubectl finds plugins by that name on PATH; the binary answers as the plugin by it).
fn install(bin: &Path, prefix: &Path) -> Result<()> {
    let dir = prefix.join("bin");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let to = dir.join("observer");
    // A new file, not written over a running binary.
    let tmp = dir.join(".observer.new");
    std::fs::copy(bin, &tmp)
        .with_context(|| format!("copying {} to {}", bin.display(), tmp.display()))?;
    std::fs::rename(&tmp, &to).with_context(|| format!("installing {}", to.display()))?;
    let link = dir.join("kubectl-observer");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("observer", &link)
        .with_context(|| format!("creating the symlink {}", link.display()))?;
    println!(
        "installed {} and {} -> observer; with {} on PATH, `kubectl observer --help` works",
        to.display(),
        link.display(),
        dir.display()
    );
    Ok(())
}

fn observer_bin(release: bool) -> PathBuf {
    workspace_root()
        .join("target")
        .join(if release { "release" } else { "debug" })
        .join("observer")
}

fn need_root(what: &str) -> Result<()> {
    if !is_root() {
        bail!(
            "`cargo xtask {what}` needs root (network namespaces, BPF); run it with sudo or as root"
        );
    }
    Ok(())
}

/// Starts `observer tail` and waits for its ready file.
fn start_tail(bin: &Path, args: &[&str], stdout: Stdio) -> Result<Child> {
    start_observer(bin, "tail", args, stdout)
}

/// Starts `observer <command>` (tail or agent) and waits for its ready file.
fn start_observer(bin: &Path, command: &str, args: &[&str], stdout: Stdio) -> Result<Child> {
    let ready = std::env::temp_dir().join(format!("observer-ready-{}", std::process::id()));
    let _ = std::fs::remove_file(&ready);
    let mut child = Command::new(bin)
        .arg(command)
        .args(args)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(stdout)
        .spawn()?;
    // Generous: a loaded machine, or a 40,000-rule node, reads its rules slowly.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ready.exists() {
        if let Some(status) = child.try_wait()? {
            bail!("observer {command} exited before it was ready: {status}");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("observer {command} was not ready after 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_file(&ready);
    Ok(child)
}

fn stop(child: &mut Child) -> Result<()> {
    // SIGINT: the observer detaches and prints its summary.
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    child.wait()?;
    Ok(())
}

/// Builds the release binary, brings up a lab with `prefix`, runs `job` with the binary's
/// path, and always removes the lab again.
fn in_lab<T>(
    task: &str,
    prefix: &str,
    mode: &str,
    build_first: bool,
    job: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let tc = setup()?;
    if build_first {
        build(&tc, true)?;
    }
    need_root(task)?;
    let bin = observer_bin(true);
    let mut up = Command::new(&bin);
    up.args(["lab", "up", "--prefix", prefix, "--mode", mode]);
    if mode == "bridge" && task == "demo" {
        // The bridge demo shows the nft bridge-family chains too (observed by the trace).
        up.arg("--bridge-chains");
    }
    run(&mut up)?;
    let result = job(&bin);
    run(Command::new(&bin).args(["lab", "down", "--prefix", prefix]))?;
    result
}

fn demo(mode: &str) -> Result<()> {
    let prefix = "obs";
    in_lab("demo", prefix, mode, true, |bin| {
        let node = format!("{prefix}-node");
        // New interfaces announce themselves (IPv6 DAD and MLD reports, a few over the first
        // seconds): let that pass, so that the first screen shows the demo's flows.
        std::thread::sleep(Duration::from_secs(3));
        let mut args = vec!["--netns", node.as_str()];
        if mode == "bridge" {
            // The bridge-family chains observed through nf_tables' trace (the lab is ours).
            args.push("--trace-bridge-chains");
        }
        let mut tail = start_tail(bin, &args, Stdio::inherit())?;
        let sent = run(Command::new(bin).args(["lab", "traffic", "--prefix", prefix]));
        std::thread::sleep(Duration::from_millis(1500));
        stop(&mut tail)?;
        sent?;
        if mode == "nftables" {
            // The rules that matter are native nftables now: explain names them by handle.
            println!("\nexplain (kube-proxy nftables mode, read live from {node}):");
            run(Command::new(bin).args([
                "explain",
                "--live",
                "--netns",
                &node,
                "--packet",
                "tcp 198.51.100.10:40000 -> 10.10.10.2:22 in eth0",
            ]))?;
        }
        Ok(())
    })
}

/// The test that runs the agent's image (tests/tests/image.rs), after the image is built.
const IMAGE_TEST: &str = "the_image_runs_as_the_daemonset_says_and_serves_metrics";

fn test(extra: &[String], allow_skips: bool, kernel_matrix: bool, fuzz_seconds: u32) -> Result<()> {
    let tc = setup()?;
    let t0 = Instant::now();
    // Where CI's time goes (its limit is the suite's whole run).
    let phase = |what: &str| eprintln!("xtask: {what} done at {:.0}s", t0.elapsed().as_secs_f64());
    run(Command::new("cargo").args(["fmt", "--all", "--check"]))
        .context("formatting differs: run `cargo fmt --all`")?;
    run(Command::new("cargo").args([
        "fmt",
        "--manifest-path",
        "observer-ebpf/Cargo.toml",
        "--check",
    ]))
    .context(
        "probe formatting differs: run `cargo fmt --manifest-path observer-ebpf/Cargo.toml`",
    )?;
    run(Command::new("cargo")
        .args([
            "clippy",
            "--locked",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])
        .env("OBSERVER_EBPF_TOOLCHAIN", &tc))?;
    phase("fmt and clippy");
    build(&tc, false)?;
    phase("the build");
    // Built while the host's tests run (niced: it takes what CPU their waits leave; a
    // separate target directory, so neither waits for the other's lock), then run by the
    // image test alone. Cached: the musl build is incremental, buildah reuses the layer
    // when the files did not change.
    let image_build = std::thread::spawn({
        let tc = tc.clone();
        move || image(&tc)
    });
    // The IPVS tests need IP_VS, which this project's host kernel lacks: there they run in
    // the kernel matrix's guests only (said here, never a silent pass).
    let mut host_skips: Vec<&str> = Vec::new();
    let _ = Command::new("modprobe").arg("ip_vs").output();
    if !std::path::Path::new("/proc/net/ip_vs").exists() {
        eprintln!(
            "xtask: this kernel has no IP_VS: the IPVS tests ({}) run in the kernel matrix's \
             guests, not here",
            matrix::GUEST_ONLY.join(", ")
        );
        if !kernel_matrix {
            eprintln!(
                "xtask: !!! and the kernel matrix is off (--no-kernel-matrix): they do not run at all"
            );
        }
        for t in matrix::GUEST_ONLY {
            host_skips.extend(["--skip", t]);
        }
    }
    // `cargo test` with what the privileged tests read: the host's run and the image's.
    let cargo_test = || {
        let mut cmd = Command::new("cargo");
        cmd.args(["test", "--locked"])
            .env("OBSERVER_EBPF_TOOLCHAIN", &tc)
            .env("OBSERVER_IMAGE", IMAGE)
            .env("KUBERNETES_VALIDATE", kubernetes_validate_bin())
            .env("OBSERVER_BIN", observer_bin(false))
            // A privileged test that cannot run fails (and says what it needs) unless asked.
            .env("OBSERVER_NO_SKIP", if allow_skips { "0" } else { "1" });
        cmd
    };
    run(cargo_test()
        .args(["--workspace", "--no-fail-fast"])
        .arg("--")
        .args(&host_skips)
        .args(["--skip", IMAGE_TEST])
        .args(extra))?;
    phase("the host's tests");
    image_build
        .join()
        .map_err(|_| anyhow::anyhow!("the image's build panicked"))??;
    phase("the image");
    run(cargo_test()
        .args(["-p", "observer-tests", "--test", "image"])
        .arg("--")
        .args(["--exact", IMAGE_TEST])
        .args(extra))?;
    phase("the image's test");
    if fuzz_seconds > 0 {
        // The suite's short run: a dev build without a sanitizer (Rust's panics, overflow
        // checks and the targets' oracles are what it finds), a few minutes to build instead
        // of ten; `cargo xtask fuzz` builds the full optimised, address-sanitised targets.
        fuzz(fuzz_seconds, &[], true)?;
        phase("the fuzz run");
    } else {
        eprintln!("xtask: !!! the fuzz run was left out (--fuzz-seconds 0) !!!");
    }
    if kernel_matrix {
        matrix::run(&tc, &observer_bin(false))?;
    } else {
        eprintln!("xtask: !!! the kernel matrix was left out (--no-kernel-matrix) !!!");
    }
    eprintln!(
        "xtask: all tests passed in {:.0}s",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs an iperf3 server in the pod and a client in the client namespace (traffic stays in
/// the lab's namespaces); returns the client's JSON report.
fn iperf3(prefix: &str, client_args: &[&str]) -> Result<serde_json::Value> {
    let client = format!("{prefix}-client");
    let mut server = iperf3_server(prefix)?;
    let out = output(
        Command::new("ip")
            .args(["netns", "exec", &client, "iperf3", "-J", "-p", "5201"])
            .args(client_args),
    );
    let _ = server.wait();
    Ok(serde_json::from_str(&out?)?)
}

/// An iperf3 server for one test in the lab's pod (port 5201), given time to listen.
fn iperf3_server(prefix: &str) -> Result<std::process::Child> {
    let server = Command::new("ip")
        .args(["netns", "exec", &format!("{prefix}-pod")])
        .args(["iperf3", "-s", "-1", "-p", "5201"])
        .stdout(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(300));
    Ok(server)
}

/// iperf3 client arguments of a flood to the lab's pod: unlimited 64-byte UDP datagrams.
const UDP_FLOOD: [&str; 7] = ["-c", "172.17.0.5", "-u", "-b", "0", "-l", "64"];

/// TCP throughput client -> ClusterIP (DNAT, masquerade) -> pod, in bit/s.
fn tcp_rate(prefix: &str, seconds: u32) -> Result<f64> {
    // The ClusterIP service maps port 22; the server listens on 5201 in the pod, so the
    // client goes to the pod's address through the node (forwarded, Calico rules).
    let v = iperf3(prefix, &["-c", "172.17.0.5", "-t", &seconds.to_string()])?;
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .context("iperf3 reported no throughput")
}

/// UDP 64-byte packets forwarded client -> pod, counted at the receiver, per second.
fn udp_rate(prefix: &str, seconds: u32) -> Result<f64> {
    let v = iperf3(
        prefix,
        &[&UDP_FLOOD[..], &["-t", &seconds.to_string()]].concat(),
    )?;
    let sum = &v["end"]["sum"];
    let sent = sum["packets"]
        .as_f64()
        .context("iperf3 reported no packets")?;
    let lost = sum["lost_packets"].as_f64().unwrap_or(0.0);
    let secs = sum["seconds"].as_f64().unwrap_or(f64::from(seconds));
    Ok((sent - lost) / secs)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// kube-proxy-shaped iptables-restore input (nat table): `services` ClusterIP services with
/// two endpoints each, eight rules per service (the service rule, the masquerade mark, two
/// probability jumps, and per endpoint its hairpin mark and DNAT).
fn kube_proxy_rules(services: usize) -> String {
    let mut chains = String::from(
        ":KUBE-SERVICES - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-POSTROUTING - [0:0]\n",
    );
    let mut rules = String::from(
        "-A PREROUTING -j KUBE-SERVICES\n-A OUTPUT -j KUBE-SERVICES\n\
         -A POSTROUTING -j KUBE-POSTROUTING\n\
         -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
         -A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE\n",
    );
    for i in 0..services {
        let ip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
        let svc = format!("KUBE-SVC-{i:016}");
        let name = format!("ns{}/svc{i}:http", i % 50);
        chains.push_str(&format!(":{svc} - [0:0]\n"));
        rules.push_str(&format!(
            "-A KUBE-SERVICES -d {ip}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j {svc}\n\
             -A {svc} ! -s 10.244.0.0/16 -d {ip}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ\n"
        ));
        for (e, last) in [(0, false), (1, true)] {
            let sep = format!("KUBE-SEP-{i:015}{e}");
            let ep = format!("10.244.{}.{}", (2 * i + e) / 250, (2 * i + e) % 250 + 1);
            chains.push_str(&format!(":{sep} - [0:0]\n"));
            let pick = if last {
                String::new()
            } else {
                "-m statistic --mode random --probability 0.5 ".into()
            };
            rules.push_str(&format!(
                "-A {svc} -m comment --comment \"{name} -> {ep}:8080\" {pick}-j {sep}\n\
                 -A {sep} -s {ep}/32 -m comment --comment \"{name}\" -j KUBE-MARK-MASQ\n\
                 -A {sep} -p tcp -m comment --comment \"{name}\" -m tcp -j DNAT --to-destination {ep}:8080\n"
            ));
        }
    }
    format!("*nat\n{chains}{rules}COMMIT\n")
}

/// (user + system CPU seconds, resident KiB now, peak resident KiB) of a process.
fn cpu_and_rss(pid: u32) -> Result<(f64, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    let hz: f64 = String::from_utf8(Command::new("getconf").arg("CLK_TCK").output()?.stdout)?
        .trim()
        .parse()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |field: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    Ok((ticks / hz, kib("VmRSS:"), kib("VmHWM:")))
}

/// The agent (default mode) in a namespace holding a 5,000-service kube-proxy ruleset: its
/// CPU over its start (ready, then 20 s) and over the minute after (tier-0 reads every
/// 15 s), its resident memory at the end and at its peak.
fn bench_rules_read(bin: &Path) -> Result<()> {
    const SERVICES: usize = 5000;
    const WINDOW: Duration = Duration::from_secs(60);
    let ns = "obsbench-rules";
    let _ = Command::new("ip").args(["netns", "del", ns]).status();
    run(Command::new("ip").args(["netns", "add", ns]))?;
    let result = (|| -> Result<()> {
        let mut restore = Command::new("ip")
            .args(["netns", "exec", ns, "iptables-restore"])
            .stdin(Stdio::piped())
            .spawn()?;
        std::io::Write::write_all(
            restore.stdin.as_mut().context("stdin")?,
            kube_proxy_rules(SERVICES).as_bytes(),
        )?;
        drop(restore.stdin.take());
        if !restore.wait()?.success() {
            bail!("iptables-restore refused the generated ruleset");
        }
        let saved = Command::new("ip")
            .args(["netns", "exec", ns, "iptables-save"])
            .output()?;
        let rules = String::from_utf8_lossy(&saved.stdout)
            .lines()
            .filter(|l| l.starts_with("-A "))
            .count();
        // A rule for the first NETFILTER_DROP sample to name (later: loopback only).
        run(Command::new("ip").args(["netns", "exec", ns, "ip", "link", "set", "lo", "up"]))?;
        run(Command::new("ip").args([
            "netns", "exec", ns, "iptables", "-w", "-A", "OUTPUT", "-o", "lo", "-p", "udp",
            "--dport", "9", "-j", "DROP",
        ]))?;
        let socket = std::env::temp_dir().join("observer-bench-rules.sock");
        let socket = socket.to_string_lossy().into_owned();
        wait_for_quiet();
        let mut agent = start_observer(
            bin,
            "agent",
            &[
                "--netns",
                ns,
                "--metrics-addr",
                "127.0.0.1:9968",
                "--socket",
                &socket,
                "--node-name",
                "bench",
            ],
            Stdio::null(),
        )?;
        let pid = agent.id();
        // The start (reading and modelling the ruleset for the streams' rule names, tier
        // 0's first read) is its own figure.
        std::thread::sleep(Duration::from_secs(20));
        let (c0, _, _) = cpu_and_rss(pid)?;
        std::thread::sleep(WINDOW);
        let (c1, rss, hwm) = cpu_and_rss(pid)?;
        // The first NETFILTER_DROP sample: its naming reads and compiles the whole ruleset
        // (tier 1's namer thread). A short burst to 127.0.0.1:9, dropped by OUTPUT.
        let me = std::env::current_exe()?;
        output(
            Command::new("ip")
                .args(["netns", "exec", ns])
                .arg(me)
                .args(["flood", "127.0.0.1:9", "0.05"]),
        )?;
        std::thread::sleep(Duration::from_secs(20));
        let (c2, rss2, hwm2) = cpu_and_rss(pid)?;
        stop(&mut agent)?;
        println!(
            "\nagent, default mode, {rules} rules ({SERVICES} services), read every 15 s: \
             start (until ready + 20 s) {c0:.2} s of CPU; then {:.2}% of one core on average \
             over {} s; RSS {:.1} MiB at the end, {:.1} MiB at its peak \
             (targets: <= 2%, < 64 MiB)",
            100.0 * (c1 - c0) / WINDOW.as_secs_f64(),
            WINDOW.as_secs(),
            rss as f64 / 1024.0,
            hwm as f64 / 1024.0
        );
        println!(
            "then the first NETFILTER_DROP samples' naming (simulating them against the \
             ruleset): peak RSS {:.1} MiB (was {:.1}), RSS {:.1} MiB 20 s after, {:.2} s of \
             CPU (load average {})",
            hwm2 as f64 / 1024.0,
            hwm as f64 / 1024.0,
            rss2 as f64 / 1024.0,
            c2 - c1,
            load_average()
        );
        Ok(())
    })();
    let _ = Command::new("ip").args(["netns", "del", ns]).status();
    result
}

/// One phase of the benchmark: which observer runs while the workloads do.
struct Phase {
    label: &'static str,
    /// None: no observer.
    args: Option<&'static [&'static str]>,
    /// `agent` (always-on mode, nobody streaming) instead of `tail`.
    agent: bool,
    /// Issue 20's targets hold for this phase (the agent's default mode).
    targets: bool,
}

const BASELINE: usize = 0;
const FLOOR: usize = 1;
const AGENT_DEFAULT: usize = 4;

const PHASES: [Phase; 7] = [
    Phase {
        label: "baseline (no observer)",
        args: None,
        agent: false,
        targets: false,
    },
    Phase {
        label: "floor (probes return at once)",
        args: Some(&["--floor"]),
        agent: false,
        targets: false,
    },
    Phase {
        label: "observer, filter matching nothing",
        args: Some(&["--filter", "host 192.0.2.99"]),
        agent: false,
        targets: false,
    },
    Phase {
        label: "observer tracing everything",
        args: Some(&[]),
        agent: false,
        targets: false,
    },
    Phase {
        label: "agent, default mode (kernel: tiers 0+1)",
        args: Some(&[]),
        agent: true,
        targets: true,
    },
    Phase {
        label: "agent brackets floor (its probes return)",
        args: Some(&["--mode", "brackets", "--floor"]),
        agent: true,
        targets: false,
    },
    Phase {
        label: "agent, --mode brackets",
        args: Some(&["--mode", "brackets"]),
        agent: true,
        targets: false,
    },
];

/// What each phase carries through the lab, in turn.
#[derive(Clone, Copy)]
enum Workload {
    /// iperf3 TCP, client -> pod (forwarded).
    Tcp,
    /// iperf3 UDP, 64-byte datagrams, unlimited, counted at the receiver.
    Udp,
    /// 64-byte UDP datagrams that a FORWARD rule of the node drops, every one; the rate is
    /// that rule's own counter's.
    DropFlood,
}

const WORKLOADS: [Workload; 3] = [Workload::Tcp, Workload::Udp, Workload::DropFlood];

impl Workload {
    fn title(self) -> &'static str {
        match self {
            Self::Tcp => "TCP throughput, client -> pod (Gbit/s)",
            Self::Udp => "UDP 64-byte packets/s, client -> pod, counted at the pod",
            Self::DropFlood => {
                "drop flood: 64-byte UDP packets/s dropped by a FORWARD rule of the node \
                 (the rule's own counter)"
            }
        }
    }

    fn short(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::DropFlood => "drops",
        }
    }

    /// The printed rate (TCP in Gbit/s).
    fn shown(self, rate: f64) -> f64 {
        match self {
            Self::Tcp => rate / 1e9,
            Self::Udp | Self::DropFlood => rate,
        }
    }

    /// Issue 20's target for the agent's default mode, as a share of the baseline.
    fn target(self) -> f64 {
        match self {
            Self::Tcp => 0.99,
            Self::Udp => 0.97,
            Self::DropFlood => 0.90,
        }
    }

    fn rate(self, prefix: &str, seconds: u32) -> Result<f64> {
        match self {
            Self::Tcp => tcp_rate(prefix, seconds),
            Self::Udp => udp_rate(prefix, seconds),
            Self::DropFlood => drop_rate(prefix, seconds),
        }
    }
}

/// The drop flood's destination: the lab's pod, a port nothing listens on.
const FLOOD_TO: &str = "172.17.0.5:9";
/// The comment on the node's FORWARD rule that drops the flood.
const FLOOD_COMMENT: &str = "observer-bench-drop-flood";

/// Inserts (`-I`) or deletes (`-D`) the FORWARD rule that drops the flood, first in the
/// lab node's FORWARD chain (nothing else in the lab sends to that port).
fn flood_rule(prefix: &str, op: &str) -> Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args([
        "netns",
        "exec",
        &format!("{prefix}-node"),
        "iptables",
        "-w",
        op,
        "FORWARD",
    ]);
    if op == "-I" {
        cmd.arg("1");
    }
    cmd.args([
        "-p",
        "udp",
        "--dport",
        "9",
        "-m",
        "comment",
        "--comment",
        FLOOD_COMMENT,
    ]);
    cmd.args(["-j", "DROP"]);
    run(&mut cmd)
}

/// Packets the flood's FORWARD rule has dropped, from its own counter.
fn flood_dropped(prefix: &str) -> Result<u64> {
    let text = output(Command::new("ip").args([
        "netns",
        "exec",
        &format!("{prefix}-node"),
        "iptables-save",
        "-c",
        "-t",
        "filter",
    ]))?;
    let line = text
        .lines()
        .find(|l| l.contains(FLOOD_COMMENT))
        .context("the drop flood's FORWARD rule is gone from the lab node")?;
    // `[packets:bytes] -A FORWARD ...`
    line.strip_prefix('[')
        .and_then(|l| l.split(':').next())
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("no counter on the flood's rule: {line}"))
}

/// Packets per second the node's FORWARD rule drops while the client floods it (the
/// sender is this binary's hidden `flood` task, one thread, in the client namespace).
fn drop_rate(prefix: &str, seconds: u32) -> Result<f64> {
    let before = flood_dropped(prefix)?;
    let me = std::env::current_exe()?;
    let out = output(
        Command::new("ip")
            .args(["netns", "exec", &format!("{prefix}-client")])
            .arg(me)
            .args(["flood", FLOOD_TO, &seconds.to_string()]),
    )?;
    let after = flood_dropped(prefix)?;
    let elapsed: f64 = out
        .split_whitespace()
        .last()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("the flood printed no duration: {out}"))?;
    Ok((after - before) as f64 / elapsed.max(1e-3))
}

/// The hidden `flood` task: 64-byte UDP datagrams to `addr` for `seconds`, as fast as one
/// thread sends them; prints `sent failed seconds`.
fn flood(addr: std::net::SocketAddr, seconds: f64) -> Result<()> {
    if !(seconds > 0.0 && seconds <= 600.0) {
        bail!("flood: give 0 < SECONDS <= 600 (got {seconds})");
    }
    let sock = std::net::UdpSocket::bind(if addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })?;
    sock.connect(addr)?;
    let payload = [0u8; 64];
    let until = Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let (mut sent, mut failed) = (0u64, 0u64);
    while start.elapsed() < until {
        for _ in 0..256 {
            match sock.send(&payload) {
                Ok(_) => sent += 1,
                // ENOBUFS and the like: the kernel's queue was full; the rule's counter
                // says what went through.
                Err(_) => failed += 1,
            }
        }
    }
    println!("{sent} {failed} {:.6}", start.elapsed().as_secs_f64());
    Ok(())
}

/// Waits (up to 20 s) until the machine is idle: the share of CPU time busy over a
/// second below a tenth. A lab removed just before (another bench, a test) leaves the
/// kernel cleaning its namespaces up in the background, which would be measured too; so
/// does an observer that just stopped or started. Not longer: on a machine shared with
/// other work it may never be quiet, and the noise floor printed says what that cost.
/// Niced work (this machine's builds run at
/// nice 19, SCHED_IDLE) counts as idle: it yields to the bench.
fn wait_for_quiet() {
    let sample = || -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = stat
            .lines()
            .next()?
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal ...
        let idle = cpu.get(1)? + cpu.get(3)? + cpu.get(4)?;
        Some((cpu.iter().take(8).sum(), idle))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let Some((t0, i0)) = sample() else { return };
        std::thread::sleep(Duration::from_secs(1));
        let Some((t1, i1)) = sample() else { return };
        let busy = 1.0 - (i1 - i0) as f64 / (t1 - t0).max(1) as f64;
        if busy < 0.10 {
            return;
        }
        if Instant::now() > deadline {
            eprintln!(
                "xtask bench: the machine is still {:.0}% busy; measuring anyway",
                busy * 100.0
            );
            return;
        }
        eprintln!(
            "xtask bench: waiting for a quiet machine ({:.0}% busy)",
            busy * 100.0
        );
    }
}

/// The 1-minute load average, as /proc/loadavg says.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// `min-max` of ratios.
fn range(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if v.is_empty() {
        "-".into()
    } else {
        format!("{lo:.3}-{hi:.3}")
    }
}

/// Why the bench times netfilter links only.
const FENTRY_NOT_TIMED: &str = "xtask bench: the fentry capture backend (kernels before 6.4) \
     is not timed: this machine's kernel refuses fentry programs (EPERM), and the kernels that \
     take them run here only under QEMU's software emulation, whose rates say nothing about a \
     node's (every instruction is translated; a guest runs the verifier alone about five times \
     slower). The rows below are netfilter links on this machine's kernel.";

fn bench(seconds: u32, runs: u32, rounds: u32, agent_only: bool, no_build: bool) -> Result<()> {
    let runs = runs.max(1);
    let rounds = rounds.max(1);
    eprintln!("{FENTRY_NOT_TIMED}");
    // The phases run, the baseline first.
    let sel: Vec<usize> = if agent_only {
        vec![BASELINE, AGENT_DEFAULT]
    } else {
        (0..PHASES.len()).collect()
    };
    let floor = (!agent_only).then_some(FLOOR);
    let nw = WORKLOADS.len();
    // The one-core benches first: after the lab is removed, the kernel cleans its
    // namespaces up in the background for a while, which would take their CPU.
    wait_for_quiet();
    if !agent_only {
        let example = |package: &str, name: &str| {
            run(Command::new("cargo").args([
                "run",
                "--locked",
                "--release",
                "-q",
                "-p",
                package,
                "--example",
                name,
            ]))
        };
        println!("collector, synthetic records (observer/examples/collector_bench.rs):");
        example("observer", "collector_bench")?;
        println!("\nruleset model (observer-rules/examples/bench_rules.rs):");
        example("observer-rules", "bench_rules")?;
        println!(
            "\nwhatif, 100,000 traversals against 5,000 services (observer/examples/whatif_bench.rs):"
        );
        example("observer", "whatif_bench")?;
        println!("\nthe agent's /metrics, 14,098 series (observer/examples/metrics_bench.rs):");
        example("observer", "metrics_bench")?;
    }
    let prefix = "obsbench";
    let node = format!("{prefix}-node");
    // Per phase and workload: the round's rate (the baseline: every one measured, in time
    // order), and each round's ratio against the baselines measured just before and after.
    let mut rates = vec![vec![Vec::new(); nw]; PHASES.len()];
    let mut ratio = vec![vec![Vec::new(); nw]; PHASES.len()];
    // The observer's (seen, printed, lost), tail phases only.
    let mut stats = vec![(0u64, 0u64, 0u64); PHASES.len()];
    let stats_file =
        std::env::temp_dir().join(format!("observer-bench-{}.json", std::process::id()));
    let mut sigint_ms = None;
    let mut loads = Vec::new();
    let started = Instant::now();
    in_lab("bench", prefix, "iptables", !no_build, |bin| {
        flood_rule(prefix, "-I")?;
        // One phase's rates: its observer started, `runs` runs of each workload taking
        // turns, their medians; the observer's figures added to `stats`.
        let mut measure = |round: u32, i: usize| -> Result<Vec<f64>> {
            let phase = &PHASES[i];
            eprintln!(
                "xtask bench: round {}/{rounds}, {} (load average {})",
                round + 1,
                phase.label,
                load_average()
            );
            loads.push(load_average());
            let socket =
                std::env::temp_dir().join(format!("observer-bench-{}.sock", std::process::id()));
            let socket = socket.to_string_lossy().into_owned();
            let mut tail = match phase.args {
                None => None,
                Some(extra) if phase.agent => {
                    let mut all = vec![
                        "--netns",
                        node.as_str(),
                        "--metrics-addr",
                        "127.0.0.1:19966",
                        "--socket",
                        &socket,
                    ];
                    all.extend_from_slice(extra);
                    Some(start_observer(bin, "agent", &all, Stdio::null())?)
                }
                Some(args) => {
                    let mut all = vec!["--netns", node.as_str(), "--json", "--stats"];
                    let path = stats_file.to_string_lossy().into_owned();
                    all.push(&path);
                    all.extend_from_slice(args);
                    Some(start_tail(bin, &all, Stdio::null())?)
                }
            };
            // Every phase starts on a settled machine: the previous observer's exit (tcx
            // links released one RCU grace period at a time, programs freed) and this one's
            // start (rules read after it is ready) are not the phase's price.
            wait_for_quiet();
            let r = (|| -> Result<Vec<Vec<f64>>> {
                let mut v = vec![Vec::new(); nw];
                for _ in 0..runs {
                    for (w, load) in WORKLOADS.iter().enumerate() {
                        v[w].push(load.rate(prefix, seconds)?);
                    }
                }
                Ok(v)
            })();
            if let Some(t) = tail.as_mut() {
                stop(t)?;
                if phase.agent {
                    // The agent prints no --stats: its counters are in /metrics.
                } else if let Ok(text) = std::fs::read_to_string(&stats_file) {
                    let v: serde_json::Value = serde_json::from_str(&text)?;
                    let n = |k: &str| v[k].as_u64().unwrap_or(0);
                    stats[i].0 += n("seen");
                    stats[i].1 += n("printed");
                    stats[i].2 += n("lost");
                }
            }
            Ok(r?.iter_mut().map(|v| median(v)).collect())
        };
        for round in 0..rounds {
            // A baseline before the first phase and after each one: a phase's ratio is
            // taken against the mean of the two around it, measured seconds before and
            // after (this VM's speed drifts by a tenth from one minute to the next). Every
            // other round runs the phases backwards.
            let mut order = sel[1..].to_vec();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut before = measure(round, BASELINE)?;
            for w in 0..nw {
                rates[BASELINE][w].push(before[w]);
            }
            for i in order {
                let r = measure(round, i)?;
                let after = measure(round, BASELINE)?;
                for w in 0..nw {
                    rates[BASELINE][w].push(after[w]);
                    rates[i][w].push(r[w]);
                    ratio[i][w].push(2.0 * r[w] / (before[w] + after[w]));
                }
                before = after;
            }
        }
        if !agent_only {
            // The tight figure of tests/tests/load.rs (which asserts only what holds on a
            // loaded machine, 1 s): SIGINT to exit while a flood runs, on a quiet machine.
            let mut exits = Vec::new();
            for _ in 0..3 {
                wait_for_quiet();
                exits.push(sigint_during_flood(bin, prefix)?.as_secs_f64() * 1e3);
            }
            let spread = exits
                .iter()
                .map(|ms| format!("{ms:.0}"))
                .collect::<Vec<_>>()
                .join(" ");
            sigint_ms = Some((median(&mut exits), spread));
        }
        flood_rule(prefix, "-D")
    })?;
    let _ = std::fs::remove_file(&stats_file);
    // The noise floor: each baseline against the mean of the two measured around it, the
    // same ratio a phase that costs nothing would get.
    let noise: Vec<Vec<f64>> = (0..nw)
        .map(|w| {
            rates[BASELINE][w]
                .windows(3)
                .map(|b| 2.0 * b[1] / (b[0] + b[2]))
                .collect()
        })
        .collect();
    let spread = |v: &[f64]| -> String {
        v.iter()
            .map(|r| format!("{r:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "\nThrough the lab node (client -> pod, forwarded with Calico's rules), {runs} runs of \
         {seconds} s per workload, phase and round (their median is the round's rate), {rounds} \
         rounds (every other one backwards), a baseline before the first phase and after each; \
         rates are medians; ratio: the median of each round's ratio against the mean of the \
         baselines just before and after it; rounds: those ratios' range; noise: a baseline \
         against the two around it, the ratio of a phase that costs nothing \
         ({:.0} s in all; load average at each phase's start: {}):",
        started.elapsed().as_secs_f64(),
        loads.join(" ")
    );
    for (w, load) in WORKLOADS.iter().enumerate() {
        println!("\n{}:", load.title());
        println!(
            "  {:<42} {:>12} {:>7} {:>13} {:>7}  target",
            "phase", "rate", "ratio", "rounds", "/floor"
        );
        let mut nz = noise[w].clone();
        let noise_dev = {
            let mut d: Vec<f64> = nz.iter().map(|r| (r - 1.0).abs()).collect();
            if d.is_empty() { 0.0 } else { median(&mut d) }
        };
        for &i in &sel {
            let phase = &PHASES[i];
            let rate = median(&mut rates[i][w].clone());
            if i == BASELINE {
                println!(
                    "  {:<42} {:>12.2} {:>7} {:>13} {:>7}",
                    phase.label,
                    load.shown(rate),
                    "1",
                    "-",
                    "-"
                );
                println!(
                    "  {:<42} {:>12} {:>7.3} {:>13} {:>7}  (median |1 - ratio| {:.3})",
                    "  noise: a baseline against its neighbours",
                    "",
                    if nz.is_empty() {
                        f64::NAN
                    } else {
                        median(&mut nz)
                    },
                    range(&noise[w]),
                    "",
                    noise_dev
                );
                continue;
            }
            let r = median(&mut ratio[i][w].clone());
            let over_floor = floor.map_or("-".to_string(), |f| {
                let mut v: Vec<f64> = ratio[i][w]
                    .iter()
                    .zip(&ratio[f][w])
                    .map(|(a, b)| a / b)
                    .collect();
                format!("{:.3}", median(&mut v))
            });
            let target = if phase.targets {
                let t = load.target();
                let verdict = if r >= t {
                    "met"
                } else if r + noise_dev >= t {
                    "not met, within the noise"
                } else {
                    "NOT met"
                };
                format!(">= {t:.2}: {verdict}")
            } else {
                String::new()
            };
            println!(
                "  {:<42} {:>12.2} {:>7.3} {:>13} {:>7}  {target}",
                phase.label,
                load.shown(rate),
                r,
                range(&ratio[i][w]),
                over_floor,
            );
        }
    }
    println!("\nEach round's ratio against the baselines around it, in round order:");
    for &i in &sel[1..] {
        let cells: Vec<String> = WORKLOADS
            .iter()
            .enumerate()
            .map(|(w, l)| format!("{} {}", l.short(), spread(&ratio[i][w])))
            .collect();
        println!("  {:<42} {}", PHASES[i].label, cells.join("  "));
    }
    let noise_cells: Vec<String> = WORKLOADS
        .iter()
        .enumerate()
        .map(|(w, l)| format!("{} {}", l.short(), spread(&noise[w])))
        .collect();
    println!("  {:<42} {}", "noise (baselines)", noise_cells.join("  "));
    // Tier 2's duty cycle: armed for ON of every PERIOD, the agent costs what --mode
    // brackets costs while armed and what the default mode costs otherwise.
    let brackets = PHASES.len() - 1;
    if sel.contains(&AGENT_DEFAULT) && sel.contains(&brackets) {
        let (on, period) = (2.0, 60.0);
        let cells: Vec<String> = WORKLOADS
            .iter()
            .enumerate()
            .map(|(w, l)| {
                let d = median(&mut ratio[AGENT_DEFAULT][w].clone());
                let b = median(&mut ratio[brackets][w].clone());
                format!("{} {:.3}", l.short(), (on * b + (period - on) * d) / period)
            })
            .collect();
        println!(
            "\nThe agent's default mode with `--window 2s/60s` (brackets armed 2 s of every 60, \
             the rest as the default mode), its average ratio from the two phases above: {}",
            cells.join("  ")
        );
    }
    if !agent_only {
        println!(
            "\nseen/printed/lost: packets, summed over the rounds, from tail's --stats (the floor \
             and the filter print nothing by design; the agent counts in the kernel, its \
             figures are in its /metrics):"
        );
        for &i in &sel {
            let phase = &PHASES[i];
            if phase.args.is_some() && !phase.agent {
                let (seen, printed, lost) = stats[i];
                println!(
                    "  {:<42} seen {seen:>12} printed {printed:>12} lost {lost:>10}",
                    phase.label
                );
            }
        }
    }
    if let Some((ms, spread)) = sigint_ms {
        println!(
            "\nSIGINT to exit of `observer tail --json` during a 64-byte UDP flood: {ms:.0} ms \
             (median of {spread} ms; target: under 200 ms)"
        );
    }
    Ok(())
}

/// How long `observer tail` takes from SIGINT to its exit while a UDP flood (iperf3,
/// unlimited, 64-byte datagrams) goes through the lab's node.
fn sigint_during_flood(bin: &Path, prefix: &str) -> Result<Duration> {
    let node = format!("{prefix}-node");
    let mut tail = start_tail(bin, &["--netns", &node, "--json"], Stdio::null())?;
    let mut server = iperf3_server(prefix)?;
    let mut client = Command::new("ip")
        .args(["netns", "exec", &format!("{prefix}-client")])
        .args(["iperf3", "-p", "5201"])
        .args(UDP_FLOOD)
        .args(["-t", "4"])
        .stdout(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_secs(2));
    let t = Instant::now();
    let _ = Command::new("kill")
        .args(["-INT", &tail.id().to_string()])
        .status();
    tail.wait()?;
    let took = t.elapsed();
    client.wait()?;
    // A server whose client failed would wait for ever: it has had its chance.
    std::thread::sleep(Duration::from_millis(500));
    let _ = server.kill();
    server.wait()?;
    Ok(took)
}
