//! `cargo xtask vm`: boot one of Debian's kernels (6.1 or 6.12) under QEMU and run a command
//! in it, as root, on a copy-on-write view of this machine's root file system.
//!
//! - Kernels come from Debian's `linux-image-*` packages: downloaded with `apt-get download`
//!   and unpacked with `dpkg-deb -x`, never installed. The ELF vmlinux is taken out of the
//!   vmlinuz (QEMU boots it through its PVH entry, skipping the decompressor).
//! - The guest's root is the host's `/` shared read-only over virtio-9p as the lower layer of
//!   an overlay with a tmpfs upper layer (writes work and stay in the guest); the kernel's own
//!   modules are mounted over `/lib/modules/<version>`, so module autoload works.
//! - QEMU runs with software emulation (TCG): this machine kind's KVM is paravirtual and
//!   does not boot stock kernels (docs in /work/shared/docs/platform-notes.md).
//! - The command goes base64-encoded on the kernel command line; its output comes back on the
//!   serial console, followed by `OBSERVER-VM-EXIT <status>`.
//!
//! Cache (`$OBSERVER_VM_CACHE`, default `/var/cache/observer-vm`), reused across runs:
//! `debs/` the downloaded packages; `<version>/` one per kernel (`root/` the unpacked package
//! with depmod's files, `vmlinux`, `initramfs-<key>.cpio`), complete when it exists (built
//! under a temporary name and renamed); `logs/<version>-<time>-<pid>.log` every run's whole
//! console (the newest 20 per kernel are kept).

use std::collections::HashSet;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

use crate::{install_packages, is_root, output, run};

/// The kernel series `--kernel` accepts (`all` is both, side by side).
pub const SERIES: &[&str] = &["6.1", "6.12"];
const DEFAULT_CACHE: &str = "/var/cache/observer-vm";
/// The guest's init, both stages (see the script's header).
const INIT: &str = include_str!("../vm/init.sh");
/// Modules the initramfs loads before it can mount the root (with their dependencies; the
/// ones built into a kernel are skipped).
const INITRAMFS_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];
const START_MARKER: &str = "OBSERVER-VM-START";
const EXIT_MARKER: &str = "OBSERVER-VM-EXIT ";
/// The kernel's command line is at most 2048 bytes on x86; what is left for the command.
const MAX_RUN_PARAM: usize = 1800;
const LOGS_KEPT: usize = 20;

/// A kernel ready to boot: everything lives in the cache.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// "6.1" or "6.12".
    pub series: &'static str,
    /// The kernel's release (`uname -r` in the guest), e.g. `6.12.117+deb12-amd64`.
    pub version: String,
    /// The ELF image QEMU boots.
    pub vmlinux: PathBuf,
    pub initramfs: PathBuf,
    /// `/lib/modules/<version>` of the unpacked package (depmod has run on it).
    pub modules: PathBuf,
}

/// How to run a guest.
#[derive(Debug, Clone)]
pub struct VmOptions {
    pub cpus: u32,
    pub memory_mib: u32,
    /// QEMU is killed after this long and the run fails.
    pub timeout: Duration,
    /// The command's working directory in the guest (the host's path: the host's root is the
    /// guest's).
    pub cwd: PathBuf,
    /// Environment variables set for the command (besides HOME, PATH, TERM=dumb and
    /// OBSERVER_VM_KERNEL, which the guest sets).
    pub env: Vec<(String, String)>,
    /// Copy the command's output lines to stdout while it runs, each after this prefix;
    /// None: only collect them.
    pub echo: Option<String>,
    /// A host directory the guest may write, at the same path (everything else the guest
    /// writes stays in its memory): where its tests leave results for the host.
    pub share: Option<PathBuf>,
}

impl Default for VmOptions {
    fn default() -> Self {
        VmOptions {
            cpus: 2,
            memory_mib: 1024,
            timeout: Duration::from_secs(1800),
            cwd: PathBuf::from("/"),
            env: Vec::new(),
            echo: Some(String::new()),
            share: None,
        }
    }
}

/// A command that ran to its end in a guest.
#[derive(Debug, Clone)]
pub struct GuestRun {
    /// The kernel's release.
    pub kernel: String,
    /// The command's exit status (what the guest's shell reported: 0-255).
    pub status: i32,
    /// The command's output (stdout and stderr, in order), without the boot messages.
    #[allow(
        dead_code,
        reason = "for callers that check the output (`cargo xtask test`)"
    )]
    pub output: String,
    /// From QEMU's start to its exit.
    pub seconds: f64,
    /// The whole console, boot included.
    pub log: PathBuf,
}

/// The cache directory (`$OBSERVER_VM_CACHE` or `/var/cache/observer-vm`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("OBSERVER_VM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE))
}

/// `cargo xtask vm`: runs `cmd` in the guests of `which` ("6.1", "6.12" or "all"); returns the
/// exit status for the xtask (the guest command's, or the first failed one's with "all").
/// What `cargo xtask vm` was asked for.
pub struct VmTask<'a> {
    /// `6.1`, `6.12` or `all`.
    pub which: &'a str,
    pub cpus: Option<u32>,
    pub memory_mib: u32,
    pub timeout_secs: u64,
    /// Host environment variables passed to the command.
    pub env_names: &'a [String],
    /// A host directory the guest may write (same path).
    pub share: Option<PathBuf>,
    pub cwd: PathBuf,
}

pub fn vm_task(task: VmTask<'_>, cmd: &[String]) -> Result<i32> {
    let VmTask {
        which,
        cpus,
        memory_mib,
        timeout_secs,
        env_names,
        share,
        cwd,
    } = task;
    let series: Vec<&'static str> = if which == "all" {
        SERIES.to_vec()
    } else {
        vec![
            SERIES
                .iter()
                .copied()
                .find(|s| *s == which)
                .with_context(|| format!("unknown kernel {which:?}: 6.1, 6.12 or all"))?,
        ]
    };
    let mut env = Vec::new();
    for name in std::iter::once(&"CI".to_string()).chain(env_names) {
        match std::env::var(name) {
            Ok(value) => env.push((name.clone(), value)),
            Err(_) if name == "CI" => {}
            Err(_) => bail!("--env {name}: {name} is not set on the host"),
        }
    }
    let kernels = series
        .iter()
        .map(|s| prepare(s))
        .collect::<Result<Vec<_>>>()?;
    let several = kernels.len() > 1;
    let opts = VmOptions {
        // Two guests at once: one CPU each (with two each they take three times as long).
        cpus: cpus.unwrap_or(if several { 1 } else { 2 }),
        memory_mib,
        timeout: Duration::from_secs(timeout_secs),
        cwd,
        env,
        echo: Some(String::new()),
        share,
    };
    if !several {
        let r = run_in_guest(&kernels[0], cmd, &opts)?;
        eprintln!(
            "xtask: vm {}: exit {} in {:.1}s",
            r.kernel, r.status, r.seconds
        );
        if r.status != 0 {
            eprintln!("xtask: vm console log: {}", r.log.display());
        }
        return Ok(r.status);
    }
    let results: Vec<Result<GuestRun>> = std::thread::scope(|scope| {
        let handles: Vec<_> = kernels
            .iter()
            .map(|k| {
                let opts = VmOptions {
                    echo: Some(format!("[{}] ", k.series)),
                    ..opts.clone()
                };
                scope.spawn(move || run_in_guest(k, cmd, &opts))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("guest thread panicked"))
            .collect()
    });
    let mut code = 0;
    for (k, r) in kernels.iter().zip(&results) {
        match r {
            Ok(r) => {
                eprintln!(
                    "xtask: vm {} ({}): exit {} in {:.1}s",
                    k.series, r.kernel, r.status, r.seconds
                );
                if r.status != 0 {
                    eprintln!("xtask: vm {} console log: {}", k.series, r.log.display());
                }
                if code == 0 {
                    code = r.status;
                }
            }
            Err(e) => {
                eprintln!("xtask: vm {} ({}): failed: {e:#}", k.series, k.version);
                if code == 0 {
                    code = 1;
                }
            }
        }
    }
    Ok(code)
}

/// Makes the newest Debian kernel of `series` ("6.1" or "6.12") bootable: packages it needs
/// on the host, the kernel package downloaded and unpacked, depmod, vmlinux, initramfs. All
/// cached; only what is missing is made.
pub fn prepare(series: &str) -> Result<Kernel> {
    let series: &'static str = SERIES
        .iter()
        .copied()
        .find(|s| *s == series)
        .with_context(|| format!("unknown kernel series {series:?} (6.1 or 6.12)"))?;
    static PACKAGES_CHECKED: Mutex<bool> = Mutex::new(false);
    {
        let mut checked = PACKAGES_CHECKED.lock().unwrap_or_else(|e| e.into_inner());
        if !*checked {
            install_packages()?;
            *checked = true;
        }
    }
    let cache = cache_dir();
    let version = newest_version(series, &cache)?;
    let dir = cache.join(&version);
    if !dir.join("vmlinux").exists() {
        fs::create_dir_all(&cache).with_context(|| {
            format!(
                "cannot create {} (run as root, or set OBSERVER_VM_CACHE)",
                cache.display()
            )
        })?;
        unpack_kernel(&cache, &version)
            .with_context(|| format!("cannot prepare kernel {version} in {}", dir.display()))?;
    }
    let modules = dir.join("root/lib/modules").join(&version);
    let initramfs = initramfs(&dir, &modules)
        .with_context(|| format!("cannot build the initramfs for {version}"))?;
    Ok(Kernel {
        series,
        vmlinux: dir.join("vmlinux"),
        initramfs,
        modules,
        version,
    })
}

/// The release number in a series' plain amd64 kernel (`6.1.0-<N>-amd64`,
/// `6.12.<N>+deb12-amd64`; not -rt, -cloud, -dbg, -unsigned): the newest has the largest.
fn release_number(series: &str, version: &str) -> Option<u32> {
    let rest = match series {
        "6.1" => version.strip_prefix("6.1.0-")?.strip_suffix("-amd64")?,
        _ => version
            .strip_prefix("6.12.")?
            .strip_suffix("+deb12-amd64")?,
    };
    rest.parse().ok()
}

fn newest_of(series: &str, versions: impl IntoIterator<Item = String>) -> Option<String> {
    versions
        .into_iter()
        .filter_map(|v| release_number(series, &v).map(|n| (n, v)))
        .max()
        .map(|(_, v)| v)
}

/// Both series' kernel releases that apt knows of (one `apt-cache search`: it takes most of
/// a second).
fn apt_versions() -> Result<Vec<String>> {
    let out = output(Command::new("apt-cache").args([
        "search",
        "--names-only",
        r"^linux-image-6\.(1\.0-[0-9]+|12\.[0-9]+\+deb12)-amd64$",
    ]))?;
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|p| p.strip_prefix("linux-image-"))
        .map(str::to_string)
        .collect())
}

/// The newest kernel of the series that apt knows of (after `apt-get update`, and after
/// adding bookworm-security to apt's sources if it is missing, when it knows none); without
/// any, the newest one already in the cache.
fn newest_version(series: &str, cache: &Path) -> Result<String> {
    static KNOWN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut known = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    if known.is_empty() {
        *known = apt_versions()?;
    }
    if let Some(v) = newest_of(series, known.iter().cloned()) {
        return Ok(v);
    }
    if is_root() {
        if add_apt_sources()? {
            eprintln!("xtask: added bookworm and bookworm-security to apt's sources");
        }
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        *known = apt_versions()?;
        if let Some(v) = newest_of(series, known.iter().cloned()) {
            return Ok(v);
        }
    }
    let cached = fs::read_dir(cache)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("vmlinux").exists())
        .filter_map(|e| e.file_name().into_string().ok());
    newest_of(series, cached).with_context(|| {
        format!(
            "apt knows no linux-image package of {series} and none is cached in {}: run as root \
             (apt-get update)",
            cache.display()
        )
    })
}

/// Adds `/etc/apt/sources.list.d/observer-vm.sources` with bookworm (main) and
/// bookworm-security when apt's sources name neither suite; true if it did.
fn add_apt_sources() -> Result<bool> {
    let mut text = fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    for e in fs::read_dir("/etc/apt/sources.list.d")
        .into_iter()
        .flatten()
    {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "list" || x == "sources") {
            text += &fs::read_to_string(&p).unwrap_or_default();
        }
    }
    let words: HashSet<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(str::split_whitespace)
        .collect();
    let mut suites = Vec::new();
    if !words.contains("bookworm") {
        suites.push(("http://deb.debian.org/debian", "bookworm"));
    }
    if !words.contains("bookworm-security") {
        suites.push(("http://deb.debian.org/debian-security", "bookworm-security"));
    }
    if suites.is_empty() {
        return Ok(false);
    }
    let stanzas: Vec<String> = suites
        .iter()
        .map(|(uri, suite)| {
            format!(
                "Types: deb\nURIs: {uri}\nSuites: {suite}\nComponents: main\n\
                 Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
            )
        })
        .collect();
    fs::write(
        "/etc/apt/sources.list.d/observer-vm.sources",
        format!(
            "# Added by `cargo xtask vm`: Debian 12's kernels (downloaded, never installed).\n{}",
            stanzas.join("\n")
        ),
    )?;
    Ok(true)
}

/// Downloads (if not in `debs/`) and unpacks the kernel's package into `<cache>/<version>`.
fn unpack_kernel(cache: &Path, version: &str) -> Result<()> {
    let t0 = Instant::now();
    let debs = cache.join("debs");
    fs::create_dir_all(&debs).with_context(|| {
        format!(
            "cannot create {} (run as root, or set OBSERVER_VM_CACHE)",
            debs.display()
        )
    })?;
    let package = format!("linux-image-{version}");
    let deb = match find_deb(&debs, &package)? {
        Some(deb) => deb,
        None => {
            eprintln!("xtask: downloading {package}");
            run(Command::new("apt-get")
                .args(["download", "-q", "-o", "APT::Sandbox::User=root", &package])
                .current_dir(&debs))?;
            find_deb(&debs, &package)?
                .with_context(|| format!("apt-get download left no {package}_*.deb"))?
        }
    };
    // Left by runs that were killed while unpacking (their process is gone).
    for e in fs::read_dir(cache)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some((_, pid)) = name.split_once(".tmp-")
            && !Path::new("/proc").join(pid).exists()
        {
            let _ = fs::remove_dir_all(e.path());
        }
    }
    let tmp = cache.join(format!("{version}.tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    let result = (|| -> Result<()> {
        let root = tmp.join("root");
        fs::create_dir_all(&root)?;
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
        run(Command::new("depmod").arg("-b").arg(&root).arg(version))?;
        let vmlinuz = fs::read(root.join("boot").join(format!("vmlinuz-{version}")))
            .context("no vmlinuz in the package")?;
        fs::write(tmp.join("vmlinux"), extract_vmlinux(&vmlinuz)?)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        // A damaged download is fetched again next time.
        let _ = fs::remove_file(&deb);
        return Err(e);
    }
    let dir = cache.join(version);
    if fs::rename(&tmp, &dir).is_err() {
        // Another run made it meanwhile.
        fs::remove_dir_all(&tmp)?;
        if !dir.join("vmlinux").exists() {
            bail!("cannot rename {} to {}", tmp.display(), dir.display());
        }
    }
    eprintln!(
        "xtask: kernel {version} unpacked in {:.1}s ({})",
        t0.elapsed().as_secs_f64(),
        dir.display()
    );
    Ok(())
}

fn find_deb(dir: &Path, package: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}_");
    for e in fs::read_dir(dir)? {
        let p = e?.path();
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

/// The ELF vmlinux inside a bzImage (what the kernel's `scripts/extract-vmlinux` finds): the
/// setup header locates the compressed payload, its magic names the decompressor.
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>> {
    let le32 = |at: usize| -> Option<usize> {
        Some(u32::from_le_bytes(bzimage.get(at..at + 4)?.try_into().ok()?) as usize)
    };
    if bzimage.get(0x202..0x206) != Some(b"HdrS") {
        bail!("not a bzImage (no HdrS setup header)");
    }
    let setup_sects = match bzimage[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let start = (setup_sects + 1) * 512 + le32(0x248).context("short header")?;
    let len = le32(0x24c).context("short header")?;
    let payload = bzimage
        .get(start..start + len)
        .context("payload outside the image")?;
    let tool: &[&str] = if payload.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        &["xz", "-dc", "--single-stream"]
    } else if payload.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        &["zstd", "-dc"]
    } else if payload.starts_with(&[0x1f, 0x8b]) {
        &["gzip", "-dc"]
    } else {
        bail!(
            "unknown compression (payload starts {:02x?})",
            &payload[..payload.len().min(6)]
        );
    };
    // The payload ends with the decompressed size (4 bytes) that some tools call trailing
    // garbage: their exit status is ignored, the result must be an ELF file.
    let elf = pipe_through(tool, payload, false)?;
    if !elf.starts_with(b"\x7fELF") || elf.len() < 1 << 20 {
        bail!(
            "{} did not give an ELF vmlinux ({} bytes)",
            tool[0],
            elf.len()
        );
    }
    Ok(elf)
}

/// Runs `argv` with `input` on its stdin; returns its stdout.
fn pipe_through(argv: &[&str], input: &[u8], check: bool) -> Result<Vec<u8>> {
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", argv[0]))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let out = std::thread::scope(|s| {
        s.spawn(move || {
            // The tool may stop reading early (EPIPE): its output tells.
            let _ = stdin.write_all(input);
        });
        child.wait_with_output()
    })?;
    if check && !out.status.success() {
        bail!(
            "{} failed: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out.stdout)
}

/// A module file's name as modprobe knows it: `kernel/fs/9p/9p.ko.xz` -> `9p`.
fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    base.split(".ko").next().unwrap_or(base).replace('-', "_")
}

/// The module files (relative to the modules tree) to load for `wanted`, dependencies first;
/// built-in modules are left out.
fn module_load_order(modules: &Path, wanted: &[&str]) -> Result<Vec<String>> {
    let dep = fs::read_to_string(modules.join("modules.dep")).context("no modules.dep")?;
    let deps: Vec<(String, String, Vec<String>)> = dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(file, ds)| {
            (
                module_name(file),
                file.to_string(),
                ds.split_whitespace().map(str::to_string).collect(),
            )
        })
        .collect();
    let builtin: HashSet<String> = fs::read_to_string(modules.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .map(module_name)
        .collect();
    fn visit(
        file: &str,
        deps: &[(String, String, Vec<String>)],
        order: &mut Vec<String>,
    ) -> Result<()> {
        if order.iter().any(|f| f == file) {
            return Ok(());
        }
        let (_, _, ds) = deps
            .iter()
            .find(|(_, f, _)| f == file)
            .with_context(|| format!("{file} is not in modules.dep"))?;
        for d in ds.iter().rev() {
            visit(d, deps, order)?;
        }
        order.push(file.to_string());
        Ok(())
    }
    let mut order = Vec::new();
    for name in wanted {
        let name = name.replace('-', "_");
        if builtin.contains(&name) {
            continue;
        }
        let (_, file, _) = deps
            .iter()
            .find(|(n, _, _)| *n == name)
            .with_context(|| format!("module {name} is neither built in nor in modules.dep"))?;
        visit(file, &deps, &mut order)?;
    }
    Ok(order)
}

/// FNV-1a: a stable key for what goes into an initramfs.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for part in parts {
        for b in part.iter().chain(&[0xff]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// `<dir>/initramfs-<key>.cpio`: busybox, the init script and the modules that mount the
/// root. The key covers all three, so a changed init script makes a new one.
fn initramfs(dir: &Path, modules: &Path) -> Result<PathBuf> {
    let busybox_path = Path::new("/bin/busybox");
    let busybox = fs::read(busybox_path).context("no /bin/busybox (Debian busybox-static)")?;
    let order = module_load_order(modules, INITRAMFS_MODULES)?;
    let key = fnv1a(&[&busybox, INIT.as_bytes(), order.join("\n").as_bytes()]);
    let path = dir.join(format!("initramfs-{key:016x}.cpio"));
    if path.exists() {
        return Ok(path);
    }
    let mut cpio = Cpio::default();
    for d in [
        "bin", "dev", "proc", "sys", "modules", "lower", "rw", "newroot",
    ] {
        cpio.entry(d, 0o040755, 0, &[]);
    }
    // The kernel opens /dev/console for init before anything is mounted.
    cpio.entry("dev/console", 0o020600, (5 << 8) | 1, &[]);
    cpio.entry("bin/busybox", 0o100755, 0, &busybox);
    cpio.entry("init", 0o100755, 0, INIT.as_bytes());
    let mut names = Vec::new();
    for file in &order {
        let src = modules.join(file);
        let ko = match file.rsplit('.').next() {
            Some("xz") => pipe_through(&["xz", "-dc"], &fs::read(&src)?, true)?,
            Some("zst") => pipe_through(&["zstd", "-dc"], &fs::read(&src)?, true)?,
            Some("gz") => pipe_through(&["gzip", "-dc"], &fs::read(&src)?, true)?,
            _ => fs::read(&src)?,
        };
        let name = format!("{}.ko", module_name(file));
        cpio.entry(&format!("modules/{name}"), 0o100644, 0, &ko);
        names.push(name);
    }
    cpio.entry(
        "modules.list",
        0o100644,
        0,
        (names.join("\n") + "\n").as_bytes(),
    );
    let tmp = dir.join(format!("initramfs.tmp-{}", std::process::id()));
    fs::write(&tmp, cpio.finish())?;
    fs::rename(&tmp, &path)?;
    Ok(path)
}

/// A cpio archive in the "newc" format the kernel unpacks into its initramfs.
#[derive(Default)]
struct Cpio {
    data: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: u32, content: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            if mode & 0o040000 != 0 { 2 } else { 1 },
            0,
            content.len() as u32,
            0,
            0,
            rdev >> 8,
            rdev & 0xff,
            name.len() as u32 + 1,
            0,
        ];
        self.data.extend_from_slice(b"070701");
        for f in fields {
            self.data.extend_from_slice(format!("{f:08X}").as_bytes());
        }
        self.data.extend_from_slice(name.as_bytes());
        self.data.push(0);
        self.pad();
        self.data.extend_from_slice(content);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.data.len().is_multiple_of(4) {
            self.data.push(0);
        }
    }

    fn finish(mut self) -> Vec<u8> {
        self.ino = 0;
        self.entry("TRAILER!!!", 0, 0, &[]);
        self.data
    }
}

/// `s` as one word for the shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The script the guest runs: cd, the environment, the command (every argument quoted).
fn guest_script(cmd: &[String], opts: &VmOptions) -> String {
    let mut script = format!(
        "cd {} || exit 125\n",
        shell_quote(&opts.cwd.to_string_lossy())
    );
    for (name, value) in &opts.env {
        script += &format!("export {name}={}\n", shell_quote(value));
    }
    let words: Vec<String> = cmd.iter().map(|w| shell_quote(w)).collect();
    script += &words.join(" ");
    script += "\n";
    script
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Boots `kernel` and runs `cmd` (program and arguments, no shell in between) in it as root,
/// in `opts.cwd`. Ok when the command ran to its end, whatever its status; Err when the
/// guest could not start it, died before it finished, or the timeout passed (the error
/// names the console log and quotes its end).
pub fn run_in_guest(kernel: &Kernel, cmd: &[String], opts: &VmOptions) -> Result<GuestRun> {
    if cmd.is_empty() {
        bail!("no command to run in the guest");
    }
    for (name, _) in &opts.env {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            bail!("{name:?} is not an environment variable name");
        }
    }
    let script = base64(guest_script(cmd, opts).as_bytes());
    if script.len() > MAX_RUN_PARAM {
        bail!(
            "the command and its environment take {} bytes in base64, the kernel's command line holds {MAX_RUN_PARAM}",
            script.len()
        );
    }
    let logs = cache_dir().join("logs");
    fs::create_dir_all(&logs)?;
    prune_logs(&logs, &kernel.version);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let log_path = logs.join(format!(
        "{}-{}-{}.log",
        kernel.version,
        now.as_secs(),
        std::process::id()
    ));
    let log = fs::File::create(&log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    let fsdev = |id: &str, path: &Path| {
        format!(
            "local,id={id},path={},security_model=none,readonly=on,multidevs=remap",
            path.display()
        )
    };
    let mut qemu = Command::new("qemu-system-x86_64");
    qemu.args([
        "-accel",
        "tcg,thread=multi,tb-size=128",
        "-cpu",
        "max",
        "-M",
        "q35",
        "-nodefaults",
        "-display",
        "none",
        "-serial",
        "stdio",
        "-no-reboot",
    ])
    .args(["-m", &opts.memory_mib.to_string()])
    .args(["-smp", &opts.cpus.to_string()])
    .args(["-fsdev", &fsdev("root", Path::new("/"))])
    .args(["-device", "virtio-9p-pci,fsdev=root,mount_tag=hostroot"])
    .args(["-fsdev", &fsdev("modules", &kernel.modules)])
    .args(["-device", "virtio-9p-pci,fsdev=modules,mount_tag=modules"]);
    let mut share_param = String::new();
    if let Some(dir) = &opts.share {
        let dir = dir
            .canonicalize()
            .with_context(|| format!("the shared directory {}", dir.display()))?;
        let dir = dir.to_str().filter(|d| !d.contains([' ', ',']));
        let Some(dir) = dir else {
            bail!("the shared directory's path must be UTF-8 without spaces or commas");
        };
        qemu.args([
            "-fsdev",
            &format!("local,id=share,path={dir},security_model=none,multidevs=remap"),
        ])
        .args(["-device", "virtio-9p-pci,fsdev=share,mount_tag=share"]);
        share_param = format!(" observer.share={dir}");
    }
    qemu
    .arg("-kernel")
    .arg(&kernel.vmlinux)
    .arg("-initrd")
    .arg(&kernel.initramfs)
    .args([
        "-append",
        &format!(
            "console=ttyS0 quiet loglevel=3 panic=-1 rdinit=/init mitigations=off observer.run={script}{share_param}"
        ),
    ])
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let t0 = Instant::now();
    let mut child = qemu.spawn().context("cannot run qemu-system-x86_64")?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let echo = opts.echo.clone();
    let console = std::thread::spawn(move || read_console(stdout, log, echo.as_deref()));
    let errors = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut timed_out = false;
    let qemu_status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if t0.elapsed() > opts.timeout {
            timed_out = true;
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let seconds = t0.elapsed().as_secs_f64();
    let (output, status) = console.join().expect("console reader panicked");
    let qemu_errors = errors.join().expect("stderr reader panicked");
    let failure = if timed_out {
        format!(
            "guest on {} timed out after {}s; QEMU killed",
            kernel.version,
            opts.timeout.as_secs()
        )
    } else if status.is_none() {
        format!(
            "guest on {} died before the command finished (QEMU {qemu_status})",
            kernel.version
        )
    } else {
        return Ok(GuestRun {
            kernel: kernel.version.clone(),
            status: status.unwrap_or_default(),
            output,
            seconds,
            log: log_path,
        });
    };
    let text = fs::read_to_string(&log_path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(30)..].join("\n");
    let qemu_errors = if qemu_errors.trim().is_empty() {
        String::new()
    } else {
        format!("\nQEMU said: {}", qemu_errors.trim())
    };
    bail!(
        "{failure}; console log {}; its end:\n{tail}{qemu_errors}",
        log_path.display()
    )
}

/// Reads QEMU's serial console to its end: every line into the log; the lines between the
/// start and exit markers (the command's output) echoed and collected. Returns that output
/// and the status the exit marker carries (None: no marker).
fn read_console(stdout: impl Read, log: fs::File, echo: Option<&str>) -> (String, Option<i32>) {
    let mut log = std::io::BufWriter::new(log);
    let mut reader = BufReader::new(stdout);
    let mut started = false;
    let mut status = None;
    let mut collected = String::new();
    let mut raw = Vec::new();
    loop {
        raw.clear();
        match reader.read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let _ = log.write_all(&raw);
        let line = String::from_utf8_lossy(&raw);
        let line = line.trim_end_matches(['\n', '\r']);
        if status.is_some() {
            continue;
        }
        if !started {
            started = line.contains(START_MARKER);
            continue;
        }
        // The command's last line may lack its newline: the marker then ends that line.
        let mut text = line;
        if let Some(at) = line.rfind(EXIT_MARKER)
            && let Ok(code) = line[at + EXIT_MARKER.len()..].trim().parse::<i32>()
        {
            status = Some(code);
            text = &line[..at];
            if text.is_empty() {
                continue;
            }
        }
        collected.push_str(text);
        collected.push('\n');
        if let Some(prefix) = echo {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{prefix}{text}");
            let _ = out.flush();
        }
    }
    let _ = log.flush();
    (collected, status)
}

/// Keeps the newest LOGS_KEPT console logs of a kernel.
fn prune_logs(logs: &Path, version: &str) {
    let prefix = format!("{version}-");
    let mut names: Vec<String> = fs::read_dir(logs)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix) && n.ends_with(".log"))
        .collect();
    names.sort();
    let excess = names.len().saturating_sub(LOGS_KEPT - 1);
    for n in &names[..excess] {
        let _ = fs::remove_file(logs.join(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob"), "Zm9vYg==");
        assert_eq!(base64(&[0xff, 0xfe, 0xfd]), "//79");
    }

    #[test]
    fn the_script_quotes_every_word() {
        let opts = VmOptions {
            cwd: PathBuf::from("/work/it's"),
            env: vec![("CI".into(), "a b".into())],
            ..VmOptions::default()
        };
        let cmd = [
            "sh".to_string(),
            "-c".into(),
            "echo 'x' \"$CI\"; exit 3".into(),
        ];
        assert_eq!(
            guest_script(&cmd, &opts),
            "cd '/work/it'\\''s' || exit 125\nexport CI='a b'\n\
             'sh' '-c' 'echo '\\''x'\\'' \"$CI\"; exit 3'\n"
        );
    }

    #[test]
    fn newest_release_wins_by_number() {
        let v = ["6.1.0-9-amd64", "6.1.0-57-amd64", "6.1.0-57-cloud-amd64"].map(String::from);
        assert_eq!(newest_of("6.1", v).as_deref(), Some("6.1.0-57-amd64"));
        let v = [
            "6.12.99+deb12-amd64",
            "6.12.117+deb12-amd64",
            "6.12.120+deb12-rt-amd64",
        ]
        .map(String::from);
        assert_eq!(
            newest_of("6.12", v).as_deref(),
            Some("6.12.117+deb12-amd64")
        );
    }

    #[test]
    fn module_names_drop_path_and_compression() {
        assert_eq!(module_name("kernel/fs/9p/9p.ko.xz"), "9p");
        assert_eq!(module_name("kernel/net/9p/9pnet_virtio.ko"), "9pnet_virtio");
        assert_eq!(
            module_name("kernel/drivers/x/virtio-pci.ko.zst"),
            "virtio_pci"
        );
    }

    #[test]
    fn console_output_between_markers_is_kept() {
        let console = b"[ boot ] noise\r\nOBSERVER-VM-START\r\nhello\r\nlast lineOBSERVER-VM-EXIT 3\r\nreboot: Power down\r\n";
        let log = tempfile_in_target();
        let (out, status) = read_console(&console[..], log, None);
        assert_eq!(out, "hello\nlast line\n");
        assert_eq!(status, Some(3));
    }

    fn tempfile_in_target() -> fs::File {
        let p = std::env::temp_dir().join(format!("xtask-vm-test-{}.log", std::process::id()));
        let f = fs::File::create(&p).unwrap();
        let _ = fs::remove_file(&p);
        f
    }
}
