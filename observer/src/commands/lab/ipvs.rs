//! The IPVS lab (`observer lab up --mode ipvs`): the third seed's node. The iptables lab's
//! namespaces and links, with kube-proxy in IPVS mode instead (the ClusterIPs on the dummy
//! `kube-ipvs0`, virtual services in masquerade mode, kube-proxy's IPVS-mode rules and
//! ipsets, `net.ipv4.vs.conntrack=1`), Calico's chains, the CNI portmap plugin's hostport and
//! Docker's chains (`lab/node-ipvs.*`). A real server on "node2": the pod network
//! 10.244.2.0/24 routed to `ext` (203.0.113.10), which holds the pod's address.
//!
//! ```text
//!  client 198.51.100.10 --eth0-- node (kube-ipvs0: 10.10.10.2 .3 .4 .10, fd00:10::2)
//!                                  --cali1a2b-- pod  172.17.0.5  (:22 registry, :53 dns, :80 hostport 8080)
//!                                  --cali2c3d-- pod2 192.170.1.5 (:53 dns, :23 denied by policy)
//!                                  --eth1------ ext  203.0.113.10, node2's pod 10.244.2.7 (:80 web)
//! ```
//! IPVS needs `CONFIG_IP_VS` (Debian's kernels: a module); where the kernel has none the lab
//! says so before building anything.

use anyhow::{Context, Result, bail};

use super::{Lab, pipe, run};

pub const RULES: &str = include_str!("../../../../lab/node-ipvs.rules");
pub const RULES6: &str = include_str!("../../../../lab/node6-ipvs.rules");
pub const IPSETS: &str = include_str!("../../../../lab/node-ipvs.ipsets");
pub const IPVSADM: &str = include_str!("../../../../lab/node-ipvs.ipvsadm");

pub const DUMMY: &str = "kube-ipvs0";
/// ClusterIPs: registry (tcp 22, local pod), web (tcp 80, node2's pod), telnet (tcp 23,
/// pod2, dropped by Calico policy), kube-dns (udp 53, both local pods).
pub const REGISTRY_IP: &str = "10.10.10.2";
pub const WEB_IP: &str = "10.10.10.3";
pub const TELNET_IP: &str = "10.10.10.4";
pub const DNS_IP: &str = "10.10.10.10";
pub const CLUSTER_IP6: &str = "fd00:10::2";
pub const NODE_PORT: u16 = 30022;
pub const HOST_PORT: u16 = 8080;
/// The hostport's pod port (CNI portmap DNAT 198.51.100.1:8080 -> 172.17.0.5:80).
pub const HOST_PORT_TARGET: u16 = 80;
pub const REMOTE_POD_NET: &str = "10.244.2.0/24";
pub const REMOTE_POD_IP: &str = "10.244.2.7";
pub const DOCKER_NET: &str = "172.18.0.1/16";

/// Why IPVS cannot run here, if it cannot: loads `ip_vs` and looks for its proc file.
pub fn unavailable() -> Option<String> {
    // Debian builds IP_VS as a module; a kernel without it has nothing to load.
    let _ = std::process::Command::new("modprobe").arg("ip_vs").output();
    if std::path::Path::new("/proc/net/ip_vs").exists() {
        return None;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    Some(format!(
        "IPVS is not available in this kernel (Linux {release}: no /proc/net/ip_vs after \
         `modprobe ip_vs`; CONFIG_IP_VS is not set). The IPVS lab runs in a kernel that has it, \
         e.g. Debian's in a guest: cargo xtask vm --kernel 6.12 -- observer lab up --mode ipvs"
    ))
}

/// What the IPVS lab adds to the node once the iptables lab's links are up.
pub fn up(lab: &Lab) -> Result<()> {
    let node = lab.node();
    lab.sh(
        "node",
        &format!(
            "ip link add {DUMMY} type dummy; \
             for a in {REGISTRY_IP} {WEB_IP} {TELNET_IP} {DNS_IP}; do ip addr add $a/32 dev {DUMMY}; done; \
             ip -6 addr add {CLUSTER_IP6}/128 dev {DUMMY} nodad; ip link set {DUMMY} up; \
             ip link add docker0 type bridge; ip addr add {DOCKER_NET} dev docker0; \
             ip route add {REMOTE_POD_NET} via {ext} dev eth1; \
             sysctl -qw net.ipv4.vs.conntrack=1",
            ext = super::EXT_IP
        ),
    )
    .context("setting up kube-ipvs0 and IPVS's sysctls on the node")?;
    lab.sh("ext", &format!("ip addr add {REMOTE_POD_IP}/32 dev lo"))?;
    pipe(
        &["ip", "netns", "exec", &node, "ipset", "restore", "-exist"],
        IPSETS,
    )?;
    pipe(&["ip", "netns", "exec", &node, "iptables-restore"], RULES)?;
    pipe(&["ip", "netns", "exec", &node, "ip6tables-restore"], RULES6)?;
    pipe(&["ip", "netns", "exec", &node, "ipvsadm-restore"], IPVSADM).context(
        "loading the IPVS services (is the `ipvsadm` package installed? `cargo xtask setup`)",
    )?;
    let loaded = run(&["ip", "netns", "exec", &node, "ipvsadm", "-Sn"])?;
    let want = IPVSADM.lines().filter(|l| l.starts_with("-A")).count();
    let got = loaded.lines().filter(|l| l.starts_with("-A")).count();
    if got != want {
        bail!("ipvsadm-restore loaded {got} virtual services of {want}:\n{loaded}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_services_match_kube_proxys_sets_and_the_lab_addresses() {
        let t = observer_rules::ipvs::parse_ipvsadm_save(IPVSADM).unwrap();
        // Every ClusterIP service is in KUBE-CLUSTER-IP and its address in KUBE-IPVS-IPS,
        // as kube-proxy keeps them.
        for s in &t.services {
            let observer_rules::ipvs::ServiceKey::Addr { proto, addr, port } = s.key else {
                panic!("kube-proxy makes no fwmark services");
            };
            let p = observer_rules::ipvs::proto_name(proto).to_ascii_lowercase();
            if addr.to_string() == super::super::NODE_IP {
                assert_eq!(port, NODE_PORT);
                assert!(IPSETS.contains(&format!("add KUBE-NODE-PORT-TCP {port}")));
                continue;
            }
            let set = if addr.is_ipv6() { "KUBE-6-" } else { "KUBE-" };
            assert!(
                IPSETS.contains(&format!("add {set}CLUSTER-IP {addr},{p}:{port} ")),
                "{s}"
            );
            assert!(
                IPSETS.contains(&format!("add {set}IPVS-IPS {addr} ")),
                "{s}"
            );
        }
        assert!(IPVSADM.contains(&format!("-r {REMOTE_POD_IP}:80 -m")));
        assert!(RULES.contains(&format!(
            "--dport {HOST_PORT} -j DNAT --to-destination {}:{HOST_PORT_TARGET}",
            super::super::POD_IP
        )));
    }
}
