//! Builds the probe objects (`observer-ebpf`, nightly, bpfel-unknown-none) and leaves them in
//! OUT_DIR for `include_bytes!`. `OBSERVER_SKIP_EBPF=1` embeds empty objects instead, so that
//! `cargo check`/clippy work without the BPF toolchain; such a binary refuses to attach.

use std::{env, fs, path::PathBuf, process::Command};

use anyhow::{Context, bail};

const OBJECTS: [&str; 3] = ["observer-tc", "observer-nf", "observer-fentry"];

fn main() -> anyhow::Result<()> {
    let out = PathBuf::from(env::var("OUT_DIR")?);
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("..");
    let ebpf = root.join("observer-ebpf");
    for p in ["src", "Cargo.toml", "Cargo.lock"] {
        println!("cargo:rerun-if-changed={}", ebpf.join(p).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        root.join("observer-common/src").display()
    );
    println!("cargo:rerun-if-env-changed=OBSERVER_SKIP_EBPF");
    println!("cargo:rerun-if-env-changed=OBSERVER_EBPF_TOOLCHAIN");

    if env::var("OBSERVER_SKIP_EBPF").is_ok_and(|v| v == "1") {
        for name in OBJECTS {
            fs::write(out.join(name), b"")?;
        }
        return Ok(());
    }

    let toolchain = env::var("OBSERVER_EBPF_TOOLCHAIN").unwrap_or_else(|_| "nightly".into());
    let target_dir = out.join("ebpf-target");
    let mut cmd = Command::new("rustup");
    cmd.args([
        "run",
        &toolchain,
        "cargo",
        "build",
        "--release",
        "--locked",
        "--bins",
    ])
    .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
    .arg("--manifest-path")
    .arg(ebpf.join("Cargo.toml"))
    .arg("--target-dir")
    .arg(&target_dir)
    .env(
        "CARGO_ENCODED_RUSTFLAGS",
        [
            "--cfg=bpf_target_arch=\"x86_64\"",
            "-Cdebuginfo=2",
            "-Clink-arg=--btf",
            // BPF v2 adds `<`/`<=` jumps: with v1 the compiler writes `x < K` as
            // `r = K; if r > x`, whose constant is on the side that verifiers before 6.2
            // (Debian's 6.1) do not use to rule a branch out, so they walk impossible paths
            // whose contradictory bounds fail them.
            "-Ctarget-cpu=v2",
        ]
        .join("\x1f"),
    );
    // The outer cargo's settings are for the host build; they must not leak into this one.
    for key in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(key);
    }
    let status = cmd.status().with_context(|| {
        format!("cannot run `rustup run {toolchain} cargo`: run `cargo xtask setup` first")
    })?;
    if !status.success() {
        bail!(
            "building the probes failed ({status}); `cargo xtask setup` installs the nightly \
             toolchain, rust-src and bpf-linker they need"
        );
    }
    let built = target_dir.join("bpfel-unknown-none/release");
    for name in OBJECTS {
        fs::copy(built.join(name), out.join(name))
            .with_context(|| format!("copy probe object {name}"))?;
    }
    Ok(())
}
