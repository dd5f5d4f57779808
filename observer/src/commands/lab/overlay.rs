//! The two-node lab (`observer lab up --nodes 2`): two node namespaces joined by a VXLAN
//! overlay as flannel's vxlan backend (and Calico's VXLAN mode) programs it, a pod on each
//! node, kube-proxy's rules on both, and a network policy on the second. See `docs/lab.md`.
//!
//! ```text
//!  pod  10.244.0.5 --eth0--cali1a2b-- node   flannel.1 10.244.0.0/32 (VXLAN VNI 1, UDP 4789)
//!                                      eth0 192.168.60.1 ==underlay veth==
//!  pod2 10.244.1.5 --eth0--cali3c4d-- node2  flannel.1 10.244.1.0/32
//!                                      eth0 192.168.60.2
//! ```
//! Each node routes the other's pod CIDR through its `flannel.1` (`via 10.244.x.0 onlink`),
//! with the permanent neighbour entry and the forwarding-database entry (the peer's VTEP MAC
//! -> its underlay address) that flanneld writes. Both nodes carry `lab/overlay-node.rules`
//! (the service `default/web` 10.96.0.30, endpoints on node2); node2 carries
//! `lab/overlay-node2.rules`, which adds the policy dropping udp/9 to pod2.

use anyhow::{Context, Result};

use super::{Lab, pipe, veth};

pub const NODE_RULES: &str = include_str!("../../../../lab/overlay-node.rules");
pub const NODE2_RULES: &str = include_str!("../../../../lab/overlay-node2.rules");

/// The overlay device on each node, as flanneld names it, its VNI and UDP port.
pub const VXLAN_DEV: &str = "flannel.1";
pub const VNI: u32 = 1;
pub const VXLAN_PORT: u16 = 4789;
/// The underlay: a veth between the two nodes' `eth0`.
pub const UNDERLAY_DEV: &str = "eth0";
pub const NODE_IP: &str = "192.168.60.1";
pub const NODE2_IP: &str = "192.168.60.2";
/// Each node's VTEP: its address on `flannel.1` (the pod CIDR's network address) and MAC.
pub const NODE_VTEP: &str = "10.244.0.0";
pub const NODE2_VTEP: &str = "10.244.1.0";
pub const NODE_VTEP_MAC: &str = "0a:58:0a:f4:00:00";
pub const NODE2_VTEP_MAC: &str = "0a:58:0a:f4:01:00";
/// The pods and the node ends of their veths.
pub const POD_IP: &str = "10.244.0.5";
pub const POD2_IP: &str = "10.244.1.5";
pub const POD_PORT: &str = "cali1a2b";
pub const POD2_PORT: &str = "cali3c4d";
pub use super::POD_GW;
/// `default/web`: tcp 80 -> POD2_IP:8080, udp 9 -> POD2_IP:9 (dropped on node2 by the policy).
pub const SERVICE_IP: &str = "10.96.0.30";
pub const SERVICE_PORT: u16 = 80;
pub const TARGET_PORT: u16 = 8080;
pub const DENIED_PORT: u16 = 9;

/// The namespaces of the two-node lab.
pub const ROLES: [&str; 4] = ["node", "node2", "pod", "pod2"];

/// One node of the overlay: its namespace role, underlay and VTEP addresses, pod CIDR, pod.
struct Node {
    role: &'static str,
    ip: &'static str,
    vtep: &'static str,
    mac: &'static str,
    cidr: &'static str,
    pod_ip: &'static str,
    pod_port: &'static str,
    rules: &'static str,
}

const NODES: [Node; 2] = [
    Node {
        role: "node",
        ip: NODE_IP,
        vtep: NODE_VTEP,
        mac: NODE_VTEP_MAC,
        cidr: "10.244.0.0/24",
        pod_ip: POD_IP,
        pod_port: POD_PORT,
        rules: NODE_RULES,
    },
    Node {
        role: "node2",
        ip: NODE2_IP,
        vtep: NODE2_VTEP,
        mac: NODE2_VTEP_MAC,
        cidr: "10.244.1.0/24",
        pod_ip: POD2_IP,
        pod_port: POD2_PORT,
        rules: NODE2_RULES,
    },
];

/// Builds the two nodes on the namespaces `Lab::up` created.
pub(super) fn up(lab: &Lab) -> Result<()> {
    veth(&lab.node(), UNDERLAY_DEV, &lab.ns("node2"), UNDERLAY_DEV)?;
    veth(&lab.node(), POD_PORT, &lab.ns("pod"), "eth0")?;
    veth(&lab.ns("node2"), POD2_PORT, &lab.ns("pod2"), "eth0")?;
    for (role, ip) in [("pod", POD_IP), ("pod2", POD2_IP)] {
        lab.routed_pod_up(role, ip)?;
    }
    for (me, peer) in [(&NODES[0], &NODES[1]), (&NODES[1], &NODES[0])] {
        // As flanneld sets up its vxlan backend: the device with its VNI and port bound to
        // the underlay address, no learning; then per remote node a route to its pod CIDR
        // through its VTEP (onlink), the VTEP's MAC as a permanent neighbour, and the
        // forwarding-database entry sending that MAC to the node's underlay address.
        lab.sh(
            me.role,
            &format!(
                "sysctl -qw net.ipv4.ip_forward=1; \
                 ip addr add {ip}/24 dev {UNDERLAY_DEV}; \
                 ip link add {VXLAN_DEV} address {mac} type vxlan id {VNI} local {ip} \
                   dev {UNDERLAY_DEV} dstport {VXLAN_PORT} nolearning; \
                 ip link set {VXLAN_DEV} mtu 1450 up; \
                 ip addr add {vtep}/32 dev {VXLAN_DEV}; \
                 ip neigh add {peer_vtep} lladdr {peer_mac} dev {VXLAN_DEV} nud permanent; \
                 bridge fdb append {peer_mac} dev {VXLAN_DEV} dst {peer_ip}; \
                 ip route add {peer_cidr} via {peer_vtep} dev {VXLAN_DEV} onlink; \
                 ip addr add {POD_GW}/32 dev {pod_port}; \
                 ip route add {pod_ip}/32 dev {pod_port}",
                ip = me.ip,
                mac = me.mac,
                vtep = me.vtep,
                pod_port = me.pod_port,
                pod_ip = me.pod_ip,
                peer_vtep = peer.vtep,
                peer_mac = peer.mac,
                peer_ip = peer.ip,
                peer_cidr = peer.cidr,
            ),
        )
        .with_context(|| {
            format!(
                "building the overlay on {} (is the kernel built with CONFIG_VXLAN?)",
                lab.ns(me.role)
            )
        })?;
        pipe(
            &["ip", "netns", "exec", &lab.ns(me.role), "iptables-restore"],
            me.rules,
        )
        .with_context(|| {
            format!(
                "loading {}'s iptables rules (is the `iptables` package installed?)",
                lab.ns(me.role)
            )
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table<'a>(rules: &'a str, name: &str) -> &'a str {
        let start = rules.find(&format!("*{name}\n")).expect("table");
        let len = rules[start..].find("COMMIT").expect("COMMIT");
        &rules[start..start + len]
    }

    #[test]
    fn both_nodes_carry_the_same_kube_proxy_rules_and_node2_the_policy() {
        assert_eq!(table(NODE_RULES, "nat"), table(NODE2_RULES, "nat"));
        let nat = table(NODE_RULES, "nat");
        assert!(nat.contains(&format!(
            "-d {SERVICE_IP}/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport {SERVICE_PORT}"
        )));
        assert!(nat.contains(&format!("--to-destination {POD2_IP}:{TARGET_PORT}")));
        assert!(nat.contains(&format!("--to-destination {POD2_IP}:{DENIED_PORT}")));
        let policy = format!("-p udp -m udp --dport {DENIED_PORT}");
        assert!(!NODE_RULES.contains(&policy));
        assert!(table(NODE2_RULES, "filter").contains(&policy));
        assert!(NODE2_RULES.contains(&format!("-o {POD2_PORT}")));
        for rules in [NODE_RULES, NODE2_RULES] {
            assert_eq!(rules.matches("COMMIT").count(), 2);
        }
    }
}
