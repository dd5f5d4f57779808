//! The kernel matrix: the privileged tests that prove a kernel, run in a QEMU guest of each
//! kernel Kubernetes nodes run (`vm.rs`), side by side with one CPU each, after the host's
//! suite. What each kernel is declared to support is written here, once
//! ([`MATRIX`]); the tests hold the kernel to it (`tests/tests/kernels.rs`), and the run
//! writes the supported-kernels table the README shows (`target/kernel-matrix.md`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::vm::{self, GuestRun, VmOptions};

/// One kernel of the matrix: what it is declared to support and the tests run in it.
pub struct Row {
    pub series: &'static str,
    /// `OBSERVER_KERNEL_CAPTURE` for `kernels.rs`: `links`, `fentry` or `none`.
    pub capture: &'static str,
    /// Waits in the guest's tests scale by this much (`observer_tests::time_scale`): QEMU's
    /// software emulation on one CPU runs the probes' verifier and the tests' processes
    /// that much slower than this machine does.
    pub time_scale: u32,
    /// Each runs in a guest of its own (booted for it), two guests at a time.
    pub tests: &'static [Job],
}

/// One guest's work: a test binary with its arguments.
pub struct Job {
    pub bin: &'static str,
    /// Arguments after the binary's name: filters and `--skip`s.
    pub args: &'static [&'static str],
    /// About how long it took in a guest on this machine kind (boot included), in seconds:
    /// the longest start first, so that the two guests end close together.
    pub seconds: u32,
}

const fn job(bin: &'static str, args: &'static [&'static str], seconds: u32) -> Job {
    Job { bin, args, seconds }
}

/// Tests that need what this project's host kernel lacks (IP_VS): `cargo xtask test` leaves
/// them to the guests on such a host (with `--skip`, said), and the guests run them.
pub const GUEST_ONLY: &[&str] = &[
    "a_cluster_ip_request_is_one_report_with_ipvs_at_input_and_no_forward",
    "a_policy_drops_what_ipvs_sent_in_output",
    "the_agents_ipvs_series_move_by_exactly_the_connections_sent",
];

pub const MATRIX: &[Row] = &[
    // What each guest runs is held to CI's time: `kernels` (which starts, says what is
    // missing, a SIGKILLed tail leaves nothing, the agent's tiers and streams, and the
    // differential: the lab's traffic reported alike to the host's, report by report, so
    // capture, NAT, marks, conntrack, fates, drops and rules named live on this kernel equal
    // what capture.rs and fates.rs prove on the host). The whole capture/fates/agent files
    // in both guests took the matrix past 30 minutes on this machine kind.
    Row {
        series: "6.12",
        capture: "links",
        time_scale: 5,
        tests: &[
            job("kernels", &[], 330),
            // The IPVS lab: IP_VS exists only in the guests' kernels. The agent's IPVS
            // series test adds about two minutes (114 s alone here; the binary's three tests
            // took 404 s on a loaded machine).
            job("ipvs", &[], 290),
            // Bridged traffic through br_netfilter (the bridge lab; the guest loads the
            // module): whole reports with their ports, and a FORWARD rule's drop.
            job(
                "bridge",
                &[
                    "bridged_ipv4_flows_are_whole_with_their_ports_and_the_kernels_rules",
                    "a_forward_rule_drops_a_bridged_frame_and_the_report_says_where",
                ],
                170,
            ),
        ],
    },
    Row {
        series: "6.1",
        // No BPF netfilter links before 6.4: fentry/fexit trampolines, chosen by themselves.
        capture: "fentry",
        // fentry verifies about 20 programs where links verify a few: 6-34 s each under
        // emulation (6-12 s an entry, 19-34 s an exit), about 400 s for the agent's preload.
        time_scale: 10,
        tests: &[
            // `kernels` in two guests: fentry's many programs make each attach long under
            // emulation, and the agent's test attaches three times.
            job(
                "kernels",
                &[
                    "--exact",
                    "tail_attaches_or_says_which_feature_the_kernel_lacks",
                    "a_killed_tail_leaves_no_link_program_or_tc_filter",
                    DIFFERENTIAL_TEST,
                ],
                500,
            ),
            job(
                "kernels",
                &[
                    "--exact",
                    "the_agent_gets_ready_counts_drops_and_says_what_it_cannot_do",
                ],
                500,
            ),
            // IPVS through the other backend: the request's stage at INPUT 99, the replies'
            // translation at FORWARD 100 (ip_vs_out_hook's trampolines), no FORWARD for the
            // request, held to ipvsadm, conntrack and explain. The policy-drop test runs in
            // 6.12 (both passed here by hand: 1237 s on a loaded machine).
            job(
                "ipvs",
                &[
                    "--exact",
                    "a_cluster_ip_request_is_one_report_with_ipvs_at_input_and_no_forward",
                ],
                330,
            ),
        ],
    },
];

/// What one guest ran: its job's result line and status.
pub struct GuestResult {
    /// Index into [`MATRIX`] and into that row's tests.
    pub row: usize,
    pub job: usize,
    pub run: Result<GuestRun>,
    /// (binary, status, its `test result:` line).
    pub binaries: Vec<(String, i32, String)>,
}

/// Every job of the matrix, (row, job) by index, the longest first.
fn schedule() -> Vec<(usize, usize)> {
    let mut jobs: Vec<(usize, usize)> = MATRIX
        .iter()
        .enumerate()
        .flat_map(|(r, row)| (0..row.tests.len()).map(move |j| (r, j)))
        .collect();
    jobs.sort_by_key(|&(r, j)| std::cmp::Reverse(MATRIX[r].tests[j].seconds));
    jobs
}

/// Guests running at once, one CPU each: this machine kind has two.
const GUESTS_AT_ONCE: usize = 2;

/// Builds the test binaries, runs every job in a guest of its own (two guests at once, one
/// CPU each, the longest jobs first), prints what each ran and writes the table; fails when
/// any test failed in any guest.
pub fn run(tc: &str, observer_bin: &Path) -> Result<()> {
    let t0 = Instant::now();
    let binaries = test_binaries(tc)?;
    let kernels = MATRIX
        .iter()
        .map(|r| vm::prepare(r.series))
        .collect::<Result<Vec<_>>>()?;
    let dir = crate::workspace_root().join("target/vm-matrix");
    std::fs::create_dir_all(&dir)?;
    let jobs = schedule();
    let mut scripts = HashMap::new();
    for &(r, j) in &jobs {
        let path = dir.join(format!("{}-{j}.sh", MATRIX[r].series));
        std::fs::write(
            &path,
            script(&MATRIX[r], &MATRIX[r].tests[j..=j], &binaries, observer_bin)?,
        )?;
        scripts.insert((r, j), path);
    }
    // The differential: the host's lines first (the guests' are held to them).
    let differential = crate::workspace_root().join("target/differential");
    let _ = std::fs::remove_dir_all(&differential);
    std::fs::create_dir_all(&differential)?;
    let host = Command::new(&binaries["kernels"])
        .args(["--exact", DIFFERENTIAL_TEST])
        .env("OBSERVER_BIN", observer_bin)
        .env("OBSERVER_NO_SKIP", "1")
        .env("OBSERVER_DIFFERENTIAL_DIR", &differential)
        .current_dir(crate::workspace_root().join("tests"))
        .status()
        .context("running the differential on the host")?;
    if !host.success() {
        bail!("the differential test failed on the host: {DIFFERENTIAL_TEST}");
    }
    let mut env = vec![(
        "OBSERVER_DIFFERENTIAL_DIR".to_string(),
        differential.display().to_string(),
    )];
    if let Ok(ci) = std::env::var("CI") {
        env.push(("CI".to_string(), ci));
    }
    let opts = VmOptions {
        cpus: 1,
        memory_mib: 1536,
        timeout: Duration::from_secs(40 * 60),
        cwd: crate::workspace_root().join("tests"),
        env,
        echo: None,
        share: Some(differential.clone()),
    };
    eprintln!(
        "xtask: kernel matrix: {} jobs in guests of {}, {GUESTS_AT_ONCE} at once, one CPU \
         each (output kept; printed on failure)",
        jobs.len(),
        kernels
            .iter()
            .map(|k| k.version.as_str())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    let queue = std::sync::Mutex::new(jobs.into_iter());
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..GUESTS_AT_ONCE {
            scope.spawn(|| {
                loop {
                    let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some((r, j)) = next else { break };
                    let cmd = vec!["sh".to_string(), scripts[&(r, j)].display().to_string()];
                    let run = vm::run_in_guest(&kernels[r], &cmd, &opts);
                    let binaries = run.as_ref().map(|g| parse(&g.output)).unwrap_or_default();
                    let result = GuestResult {
                        row: r,
                        job: j,
                        run,
                        binaries,
                    };
                    report(&result);
                    results
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(result);
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results.sort_by_key(|r| (r.row, r.job));
    let mut failed: Vec<String> = results.iter().filter_map(failure).collect();
    match compare_differential(&differential) {
        Ok(said) => eprintln!("xtask: differential: {said}"),
        Err(e) => {
            eprintln!("xtask: differential: {e:#}");
            failed.push("the differential".to_string());
        }
    }
    let table = table(&results);
    let out = crate::workspace_root().join("target/kernel-matrix.md");
    std::fs::write(&out, &table)?;
    eprintln!(
        "xtask: kernel matrix in {:.0}s; table in {}",
        t0.elapsed().as_secs_f64(),
        out.display()
    );
    if !failed.is_empty() {
        bail!("kernel matrix failed on {}", failed.join(", "));
    }
    Ok(())
}

/// The test (in `kernels`) that writes each kernel's and backend's differential lines.
const DIFFERENTIAL_TEST: &str = "the_labs_traffic_is_reported_alike_by_every_kernel_and_backend";

/// Holds every `<kernel>-<backend>.txt` in `dir` to the host's (netfilter links): the same
/// lines, each difference printed. Returns what was compared.
fn compare_differential(dir: &Path) -> Result<String> {
    let host_release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let host_name = format!("{}-links.txt", host_release.trim());
    let read = |p: &Path| -> Result<Vec<String>> {
        Ok(std::fs::read_to_string(p)
            .with_context(|| format!("reading {}", p.display()))?
            .lines()
            .map(str::to_string)
            .collect())
    };
    let host = read(&dir.join(&host_name))?;
    let mut others: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .filter(|p| p.file_name().is_some_and(|n| n != host_name.as_str()))
        .collect();
    others.sort();
    // Every row's backend.
    let expected = MATRIX.len();
    let mut problems = Vec::new();
    for p in &others {
        let lines = read(p)?;
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        for l in host.iter().filter(|l| !lines.contains(l)) {
            problems.push(format!("{name}: missing (the host has it): {l}"));
        }
        for l in lines.iter().filter(|l| !host.contains(l)) {
            problems.push(format!("{name}: extra (the host has it not): {l}"));
        }
    }
    if others.len() < expected {
        problems.push(format!(
            "{} kernel/backend result(s) written, {expected} expected: {}",
            others.len(),
            others
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if !problems.is_empty() {
        bail!(
            "the lab's traffic is reported differently:\n{}",
            problems.join("\n")
        );
    }
    Ok(format!(
        "{} lines each, equal on {} and {host_name}",
        host.len(),
        others
            .iter()
            .map(|p| p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The integration test binaries the matrix runs, built once on the host (the guests see
/// the host's files).
fn test_binaries(tc: &str) -> Result<HashMap<String, PathBuf>> {
    let mut cmd = Command::new("cargo");
    cmd.args([
        "test",
        "--locked",
        "--no-run",
        "--message-format=json",
        "-p",
        "observer-tests",
    ])
    .env("OBSERVER_EBPF_TOOLCHAIN", tc);
    let mut names: Vec<&str> = MATRIX
        .iter()
        .flat_map(|r| r.tests.iter().map(|j| j.bin))
        .collect();
    names.sort_unstable();
    names.dedup();
    for n in &names {
        cmd.args(["--test", n]);
    }
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the matrix's test binaries")?;
    if !out.status.success() {
        bail!("building the matrix's test binaries failed");
    }
    let mut found = HashMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] == "compiler-artifact"
            && v["target"]["kind"] == serde_json::json!(["test"])
            && let (Some(name), Some(exe)) =
                (v["target"]["name"].as_str(), v["executable"].as_str())
        {
            found.insert(name.to_string(), PathBuf::from(exe));
        }
    }
    for n in names {
        if !found.contains_key(n) {
            bail!("cargo built no test binary {n}");
        }
    }
    Ok(found)
}

/// A guest's script: `jobs` of `row`, one test at a time, each closed by a marker line with
/// its exit status; the script's own status is the first failure's.
fn script(
    row: &Row,
    jobs: &[Job],
    binaries: &HashMap<String, PathBuf>,
    observer_bin: &Path,
) -> Result<String> {
    let mut s = String::from("#!/bin/sh\n# Written by cargo xtask test (xtask/src/matrix.rs).\n");
    writeln!(
        s,
        "export OBSERVER_BIN={} OBSERVER_NO_SKIP=1 OBSERVER_KERNEL_CAPTURE={} \
         OBSERVER_TIME_SCALE={} RUST_BACKTRACE=1",
        observer_bin.display(),
        row.capture,
        row.time_scale
    )?;
    // A node's prerequisites that a throwaway guest may load: br_netfilter, as kubeadm
    // requires (the bridge lab needs it; on the host it is the machine's own choice).
    s.push_str("modprobe br_netfilter 2>/dev/null\n");
    s.push_str("status=0\n");
    for Job { bin, args, .. } in jobs {
        let exe = &binaries[*bin];
        let args: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        writeln!(
            s,
            "{} --test-threads=1 {}; rc=$?; echo \"MATRIX-RESULT {bin} $rc\"; \
             [ $status -eq 0 ] && status=$rc",
            exe.display(),
            args.join(" ")
        )?;
    }
    s.push_str("exit $status\n");
    Ok(s)
}

/// Each binary's `test result:` line and status, from the guest's output.
fn parse(output: &str) -> Vec<(String, i32, String)> {
    let mut last_result = String::new();
    let mut out = Vec::new();
    for line in output.lines() {
        if let Some(r) = line.trim().strip_prefix("test result: ") {
            last_result = r.to_string();
        } else if let Some(m) = line.trim().strip_prefix("MATRIX-RESULT ") {
            let mut w = m.split_whitespace();
            if let (Some(bin), Some(rc)) = (w.next(), w.next().and_then(|r| r.parse().ok())) {
                out.push((bin.to_string(), rc, std::mem::take(&mut last_result)));
            }
        }
    }
    out
}

/// What one guest's job ran, printed as it ends (its whole output when it failed).
fn report(r: &GuestResult) {
    let row = &MATRIX[r.row];
    let what = describe(&row.tests[r.job]);
    match &r.run {
        Ok(run) => {
            eprintln!(
                "xtask: kernel {} ({}), capture {}, {what}: exit {} in {:.0}s",
                row.series, run.kernel, row.capture, run.status, run.seconds
            );
            for (bin, status, line) in &r.binaries {
                eprintln!("xtask:   {bin}: {line} (exit {status})");
            }
            if failure(r).is_some() {
                eprintln!("{}", run.output);
                eprintln!("xtask: the guest's console log: {}", run.log.display());
            }
        }
        Err(e) => eprintln!("xtask: kernel {}, {what}: {e:#}", row.series),
    }
}

/// A job's failure, said in a few words; None when it passed.
fn failure(r: &GuestResult) -> Option<String> {
    let row = &MATRIX[r.row];
    let what = describe(&row.tests[r.job]);
    match &r.run {
        Ok(run) if run.status == 0 && !r.binaries.is_empty() => None,
        Ok(run) if r.binaries.is_empty() => Some(format!(
            "{} ({what}: did not finish, exit {})",
            row.series, run.status
        )),
        Ok(run) => Some(format!("{} ({what}: exit {})", row.series, run.status)),
        Err(_) => Some(format!("{} ({what}: the guest failed)", row.series)),
    }
}

/// A job in a few words: its binary, and its tests when it runs some only.
fn describe(job: &Job) -> String {
    let tests: Vec<&str> = job
        .args
        .iter()
        .copied()
        .filter(|a| !a.starts_with("--"))
        .collect();
    if tests.is_empty() {
        job.bin.to_string()
    } else {
        format!("{} ({})", job.bin, tests.join(", "))
    }
}

/// The supported-kernels table, from what the guests ran (`results` in row order).
fn table(results: &[GuestResult]) -> String {
    let mut t = String::from(
        "| kernel | capture backend | tests run in the guest | result |\n|---|---|---|---|\n",
    );
    for (i, row) in MATRIX.iter().enumerate() {
        let ran: Vec<&GuestResult> = results.iter().filter(|r| r.row == i).collect();
        let kernel = ran
            .iter()
            .find_map(|r| r.run.as_ref().ok().map(|g| g.kernel.clone()))
            .unwrap_or_else(|| row.series.to_string());
        let backend = match row.capture {
            "links" => "netfilter links",
            "fentry" => "fentry trampolines",
            _ => "none (agent: tier 0 and tier 1 only)",
        };
        let tests: Vec<String> = ran
            .iter()
            .flat_map(|r| &r.binaries)
            .map(|(b, rc, line)| {
                format!("{b}: {}", if *rc == 0 { line.as_str() } else { "FAILED" })
            })
            .collect();
        let ok = ran.len() == row.tests.len() && ran.iter().all(|r| failure(r).is_none());
        let _ = writeln!(
            t,
            "| {kernel} | {backend} | {} | {} |",
            tests.join("; "),
            if ok { "pass" } else { "FAIL" }
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_binarys_result_line_is_paired_with_its_status() {
        let out = "running 2 tests\ntest a ... ok\n\ntest result: ok. 2 passed; 0 failed\n\
                   MATRIX-RESULT kernels 0\nnoise\ntest result: FAILED. 1 passed; 1 failed\n\
                   MATRIX-RESULT capture 101\nMATRIX-RESULT fates 1\n";
        assert_eq!(
            parse(out),
            vec![
                ("kernels".into(), 0, "ok. 2 passed; 0 failed".into()),
                ("capture".into(), 101, "FAILED. 1 passed; 1 failed".into()),
                ("fates".into(), 1, String::new()),
            ]
        );
    }

    #[test]
    fn the_script_runs_every_binary_and_exits_with_the_first_failure() {
        let bins: HashMap<String, PathBuf> =
            ["kernels", "capture", "fates", "agent", "ipvs", "bridge"]
                .iter()
                .map(|b| (b.to_string(), PathBuf::from(format!("/t/{b}"))))
                .collect();
        let s = script(&MATRIX[0], MATRIX[0].tests, &bins, Path::new("/t/observer")).unwrap();
        assert!(s.contains("OBSERVER_KERNEL_CAPTURE=links"), "{s}");
        assert!(
            s.contains("/t/bridge --test-threads=1 'bridged_ipv4_flows"),
            "{s}"
        );
        assert_eq!(s.matches("MATRIX-RESULT").count(), MATRIX[0].tests.len());
        let status = Command::new("sh")
            .arg("-c")
            .arg(
                script(
                    &MATRIX[0],
                    MATRIX[0].tests,
                    // The first fails, the others pass: the script goes on, exits 1.
                    &MATRIX[0]
                        .tests
                        .iter()
                        .enumerate()
                        .map(|(i, Job { bin: b, .. })| {
                            (
                                b.to_string(),
                                PathBuf::from(if i == 0 { "false" } else { "true" }),
                            )
                        })
                        .collect(),
                    Path::new("/x"),
                )
                .unwrap(),
            )
            .status()
            .unwrap();
        assert_eq!(status.code(), Some(1));
    }

    #[test]
    fn every_job_is_scheduled_once_the_longest_first() {
        let jobs = schedule();
        let all: usize = MATRIX.iter().map(|r| r.tests.len()).sum();
        assert_eq!(jobs.len(), all);
        let mut seen = jobs.clone();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), all, "each once: {jobs:?}");
        let secs: Vec<u32> = jobs
            .iter()
            .map(|&(r, j)| MATRIX[r].tests[j].seconds)
            .collect();
        assert!(secs.windows(2).all(|w| w[0] >= w[1]), "{secs:?}");
        // The differential runs once per kernel (compare_differential expects one file each).
        for row in MATRIX {
            let n = row
                .tests
                .iter()
                .filter(|j| {
                    j.bin == "kernels" && (j.args.is_empty() || j.args.contains(&DIFFERENTIAL_TEST))
                })
                .count();
            assert_eq!(n, 1, "{}", row.series);
        }
    }

    #[test]
    fn a_job_is_said_by_its_binary_and_its_tests() {
        assert_eq!(describe(&job("ipvs", &[], 1)), "ipvs");
        assert_eq!(
            describe(&job("kernels", &["--exact", "a", "b"], 1)),
            "kernels (a, b)"
        );
    }
}
