//! The bridge lab (`observer lab up --mode bridge`): a flannel/kubeadm-style node whose pods
//! hang off the Linux bridge `cni0`, with br_netfilter on, so bridged frames walk the node's
//! IPv4/IPv6 netfilter hooks. See `docs/lab.md` for the drawing.
//!
//! ```text
//!  client 198.51.100.10 --eth0--eth0-- node  cni0 10.244.0.1/24, fd00:10:244::1/64 (bridge)
//!                                       |     +- veth1a2b3c4d (hairpin) --eth0-- pod  10.244.0.5
//!                                       |     +- veth2c3d4e5f (hairpin) --eth0-- pod2 10.244.0.6
//!                                       +--eth1--eth0-- ext 203.0.113.10 (default route)
//!                                       +--eth2--eth0-- node2 192.168.50.2, pods 10.244.1.0/24
//! ```
//! The node carries `lab/bridge-node.rules` and `lab/bridge-node6.rules`: kube-proxy in
//! iptables mode (ClusterIPs with endpoints on this bridge and on node2), flannel's FORWARD
//! accepts and masquerade, and a network policy matching bridge ports (`physdev`).

use anyhow::{Context, Result};

use super::{Lab, pipe, veth};

pub const RULES: &str = include_str!("../../../../lab/bridge-node.rules");
pub const RULES6: &str = include_str!("../../../../lab/bridge-node6.rules");

/// The bridge the pods hang off, and its gateway addresses.
pub const BRIDGE: &str = "cni0";
pub const BRIDGE_IP: &str = "10.244.0.1";
pub const BRIDGE_IP6: &str = "fd00:10:244::1";
/// The pods' ports on the bridge (the host ends of their veths), as the bridge CNI names them.
pub const POD_PORT: &str = "veth1a2b3c4d";
pub const POD2_PORT: &str = "veth2c3d4e5f";
pub const POD_IP: &str = "10.244.0.5";
pub const POD2_IP: &str = "10.244.0.6";
pub const POD_IP6: &str = "fd00:10:244::5";
pub const POD2_IP6: &str = "fd00:10:244::6";
/// The other node (flannel host-gw route over `eth2`) and its pod, the second endpoint.
pub const NODE_LINK_IP: &str = "192.168.50.1";
pub const NODE2_IP: &str = "192.168.50.2";
pub const REMOTE_POD_IP: &str = "10.244.1.5";
/// kube-proxy's services (cluster CIDR 10.244.0.0/16, service CIDR 10.96.0.0/12):
/// `default/registry:ssh` -> POD_IP:22 (the same bridge; from the pod itself: hairpin),
/// `default/web:http` -> POD_IP:8080 or REMOTE_POD_IP:8080 (one in two at random),
/// `default/remote:http` -> REMOTE_POD_IP:80 (the other node).
pub const REGISTRY_IP: &str = "10.96.0.2";
pub const WEB_IP: &str = "10.96.0.10";
pub const REMOTE_SVC_IP: &str = "10.96.0.20";
pub const REGISTRY_IP6: &str = "fd00:96::2";
/// The network policy's port: udp to this port leaving through POD2_PORT is dropped in FORWARD.
pub const DENIED_PORT: u16 = 9;

/// The nft `bridge`-family table `observer lab up --mode bridge --bridge-chains` adds: a
/// forward chain before br_netfilter's IP hooks would run (priority -200) that counts the
/// bridged udp frames to [`L2_COUNTED_PORT`] and drops those to [`L2_DENIED_PORT`] leaving by
/// pod2's port, and counts tcp to the pod's port 22 (a ClusterIP's frames after their DNAT),
/// and a prerouting chain counting frames from the pod's port. BPF netfilter
/// links cannot attach to the bridge family: tail simulates these chains and confirms each
/// rule by its counter.
pub const BRIDGE_TABLE: &str = "bridge obs-l2";
pub const L2_COUNTED_PORT: u16 = 7002;
pub const L2_DENIED_PORT: u16 = 7003;

pub fn bridge_chains_ruleset() -> String {
    format!(
        "table {BRIDGE_TABLE} {{\n\
         \tchain prerouting {{\n\
         \t\ttype filter hook prerouting priority -300; policy accept;\n\
         \t\tiifname \"{POD_PORT}\" udp dport {L2_COUNTED_PORT} counter comment \"frames from the pod\"\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority -200; policy accept;\n\
         \t\tudp dport {L2_COUNTED_PORT} counter comment \"bridged udp/{L2_COUNTED_PORT}\"\n\
         \t\toifname \"{POD2_PORT}\" udp dport {L2_DENIED_PORT} counter drop comment \"l2 policy: deny udp/{L2_DENIED_PORT} to pod2\"\n\
         \t\tip daddr {POD_IP} tcp dport 22 counter comment \"to the registry's endpoint (after the ClusterIP's DNAT)\"\n\
         \t}}\n\
         }}\n"
    )
}

/// Adds [`bridge_chains_ruleset`] to the bridge lab's node.
pub fn add_bridge_chains(lab: &Lab) -> Result<()> {
    pipe(
        &["ip", "netns", "exec", &lab.node(), "nft", "-f", "-"],
        &bridge_chains_ruleset(),
    )
    .context(
        "loading the bridge lab's nft bridge-family table (is the `nftables` package installed?)",
    )
}

/// Builds the bridge node on the namespaces `Lab::up` created.
pub(super) fn up(lab: &Lab) -> Result<()> {
    use super::{EXT_IP, NODE_EXT_IP, NODE_IP, NODE_IP6};
    let node = lab.node();
    veth(&node, "eth2", &lab.ns("node2"), "eth0")?;
    veth(&node, POD_PORT, &lab.ns("pod"), "eth0")?;
    veth(&node, POD2_PORT, &lab.ns("pod2"), "eth0")?;
    lab.outside_up(&format!(
        "ip addr add {EXT_IP}/24 dev eth0; ip route add 10.244.0.0/16 via {NODE_EXT_IP}"
    ))?;
    for (role, ip, ip6) in [("pod", POD_IP, POD_IP6), ("pod2", POD2_IP, POD2_IP6)] {
        lab.sh(
            role,
            &format!(
                "ip addr add {ip}/24 dev eth0; ip route add default via {BRIDGE_IP}; \
                 ip -6 addr add {ip6}/64 dev eth0 nodad; ip -6 route add default via {BRIDGE_IP6}"
            ),
        )?;
    }
    // node2: another flannel node (host-gw backend); its pod's address sits on its loopback
    // (this kernel kind has no dummy interfaces).
    lab.sh(
        "node2",
        &format!(
            "ip addr add {NODE2_IP}/24 dev eth0; \
             ip addr add {REMOTE_POD_IP}/32 dev lo; ip route add 10.244.0.0/24 via {NODE_LINK_IP}; \
             ip route add default via {NODE_LINK_IP}"
        ),
    )?;
    // The bridge as the bridge CNI plugin builds it (isGateway, hairpinMode), and
    // br_netfilter on as kubeadm requires: bridged frames then walk iptables/ip6tables.
    lab.sh(
        "node",
        &format!(
            "sysctl -qw net.ipv4.ip_forward=1; sysctl -qw net.ipv6.conf.all.forwarding=1; \
             ip addr add {NODE_IP}/24 dev eth0; ip addr add {NODE_EXT_IP}/24 dev eth1; \
             ip -6 addr add {NODE_IP6}/64 dev eth0 nodad; ip addr add {NODE_LINK_IP}/24 dev eth2; \
             ip link add {BRIDGE} type bridge; \
             sysctl -qw net.ipv6.conf.{BRIDGE}.accept_dad=0; \
             ip link set {BRIDGE} up; \
             ip addr add {BRIDGE_IP}/24 dev {BRIDGE}; ip -6 addr add {BRIDGE_IP6}/64 dev {BRIDGE} nodad; \
             for p in {POD_PORT} {POD2_PORT}; do \
               ip link set $p master {BRIDGE}; bridge link set dev $p hairpin on; done; \
             sysctl -qw net.bridge.bridge-nf-call-iptables=1; \
             sysctl -qw net.bridge.bridge-nf-call-ip6tables=1; \
             ip route add 10.244.1.0/24 via {NODE2_IP} dev eth2; \
             ip route add default via {EXT_IP}"
        ),
    )
    .context("building the bridge (is br_netfilter built in or loaded? `modprobe br_netfilter`)")?;
    pipe(&["ip", "netns", "exec", &node, "iptables-restore"], RULES).context(
        "loading the bridge lab's iptables rules (is the `iptables` package installed?)",
    )?;
    pipe(&["ip", "netns", "exec", &node, "ip6tables-restore"], RULES6)
        .context("loading the bridge lab's ip6tables rules")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_name_the_lab_ports_and_addresses() {
        for rules in [RULES, RULES6] {
            assert!(rules.contains(&format!("--physdev-out {POD2_PORT}")));
            assert!(rules.contains(&format!("--dport {DENIED_PORT}")));
            assert_eq!(rules.matches("COMMIT").count(), 2);
        }
        assert!(RULES.contains(&format!("--to-destination {POD_IP}:22")));
        assert!(RULES.contains(&format!("--to-destination {REMOTE_POD_IP}:80")));
        assert!(RULES.contains(&format!("-d {REGISTRY_IP}/32")));
        assert!(RULES.contains(&format!("-d {WEB_IP}/32")));
        assert!(RULES.contains(&format!("-d {REMOTE_SVC_IP}/32")));
        assert!(RULES6.contains(&format!("--to-destination [{POD_IP6}]:22")));
        assert!(RULES6.contains(&format!("-d {REGISTRY_IP6}/128")));
    }
}
