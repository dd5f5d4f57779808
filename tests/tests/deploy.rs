//! The Kubernetes manifests in deploy/kubernetes: every one valid against the Kubernetes
//! schemas (`kubernetes-validate --strict`, offline), and the DaemonSet runs the agent the
//! way docs/deploy.md says (host network, every node, health probes, node name, mounts).

use std::path::{Path, PathBuf};
use std::process::Command;

use observer_tests::in_ci;
use serde_json::Value;

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    v.sort();
    assert!(v.len() >= 3, "manifests in {}", dir.display());
    v
}

/// kubernetes-validate (`cargo xtask setup` installs it), or None after a loud skip.
fn validator(test: &str) -> Option<PathBuf> {
    let p = std::env::var_os("KUBERNETES_VALIDATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into()))
                .join(".cache/observer/venv/bin/kubernetes-validate")
        });
    if p.exists() {
        return Some(p);
    }
    let msg = format!(
        "{test}: needs kubernetes-validate at {} (cargo xtask setup)",
        p.display()
    );
    if in_ci() {
        panic!("{msg}; CI=true, so this test fails instead of skipping");
    }
    eprintln!("\n!!!!!!!! SKIPPED {msg} !!!!!!!!\n");
    None
}

fn validate(bin: &Path, file: &Path) -> (bool, String) {
    let out = Command::new(bin)
        .arg("--strict")
        .arg(file)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn every_manifest_is_valid_against_the_kubernetes_schemas() {
    let Some(bin) = validator("every_manifest_is_valid_against_the_kubernetes_schemas") else {
        return;
    };
    for f in manifests() {
        let (ok, out) = validate(&bin, &f);
        assert!(ok, "{}: {out}", f.display());
        assert!(out.contains("passed"), "{out}");
    }
    // The validator does reject: a misspelled field in a copy of the DaemonSet.
    let bad = std::env::temp_dir().join(format!("observer-bad-ds-{}.yaml", std::process::id()));
    let ds = std::fs::read_to_string(
        manifests()
            .into_iter()
            .find(|p| p.ends_with("daemonset.yaml"))
            .unwrap(),
    )
    .unwrap();
    std::fs::write(&bad, ds.replace("hostNetwork: false", "hostNetwrok: false")).unwrap();
    let (ok, out) = validate(&bin, &bad);
    let _ = std::fs::remove_file(&bad);
    assert!(!ok, "a misspelled field passed: {out}");
}

/// The YAML documents of a file, as JSON (python3-yaml).
pub fn yaml_docs(file: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, json, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))",
        ])
        .arg(file)
        .output()
        .expect("python3 with yaml (Debian python3-yaml; cargo xtask setup installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_daemonset_runs_the_agent_on_every_node_with_what_it_needs() {
    if Command::new("python3")
        .args(["-c", "import yaml"])
        .output()
        .map_or(true, |o| !o.status.success())
    {
        assert!(!in_ci(), "python3-yaml missing under CI");
        eprintln!("\n!!!!!!!! SKIPPED: needs python3-yaml (cargo xtask setup) !!!!!!!!\n");
        return;
    }
    let docs: Vec<Value> = manifests().iter().flat_map(|f| yaml_docs(f)).collect();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for k in [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
    ] {
        assert!(kinds.contains(&k), "{k} missing: {kinds:?}");
    }
    let role = docs.iter().find(|d| d["kind"] == "ClusterRole").unwrap();
    let rules = serde_json::to_string(&role["rules"]).unwrap();
    assert!(
        rules.contains("pods") && rules.contains("services"),
        "{rules}"
    );
    assert!(
        !rules.contains("create") && !rules.contains("update") && !rules.contains("delete"),
        "read-only: {rules}"
    );
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    let pod = &ds["spec"]["template"]["spec"];
    // The API in the pod's own namespace (issue 33 §3): no hostNetwork; the node's
    // namespace entered by --node-netns from a bind of the host's /proc/1/ns/net.
    assert_ne!(pod["hostNetwork"], true);
    assert!(
        pod["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["operator"] == "Exists" && t.get("key").is_none())
    );
    let c = &pod["containers"][0];
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert!(
        c["resources"]["limits"]["memory"].is_string()
            && c["resources"]["requests"]["cpu"].is_string()
    );
    let env = serde_json::to_string(&c["env"]).unwrap();
    assert!(
        env.contains("NODE_NAME") && env.contains("spec.nodeName"),
        "{env}"
    );
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    for m in [
        "/sys/kernel/btf",
        "/sys/fs/cgroup",
        "/run/observer",
        "/run/xtables.lock",
    ] {
        assert!(mounts.contains(&m), "{m} not mounted: {mounts:?}");
    }
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--listen=127.0.0.1:9966"), "{args:?}");
    let node_netns = args
        .iter()
        .find_map(|a| a.strip_prefix("--node-netns="))
        .unwrap_or_else(|| panic!("no --node-netns: {args:?}"));
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == node_netns)
        .unwrap_or_else(|| panic!("{node_netns} not mounted"));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(volume["hostPath"]["path"], "/proc/1/ns/net");
    let caps = serde_json::to_string(&c["securityContext"]["capabilities"]["add"]).unwrap();
    assert!(caps.contains("SYS_ADMIN"), "setns needs it: {caps}");
    let ann = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    // Every flag the DaemonSet passes is one `observer agent` knows.
    let help = Command::new(observer_tests::lab::observer_bin())
        .args(["agent", "--help"])
        .output();
    if let Ok(help) = help {
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        assert_eq!(c["args"][0], "agent");
        for a in c["args"].as_array().unwrap().iter().skip(1) {
            let flag = a.as_str().unwrap().split('=').next().unwrap();
            assert!(help.contains(flag), "observer agent has no {flag}");
        }
    }
}
