//! The built-in lab: a Kubernetes-like node in network namespaces, nothing attached to the
//! root namespace. See `docs/lab.md` for the drawing.
//!
//! ```text
//!  client 198.51.100.10 --eth0--eth0-- node --cali1a2b--eth0-- pod  172.17.0.5 (:22 "registry")
//!                                       |  --cali2c3d--eth0-- pod2 192.170.1.5 (Calico pool)
//!                                       +--eth1--eth0-- ext 203.0.113.10
//! ```
//! The node carries `lab/node.rules` (kube-proxy ClusterIP 10.10.10.2:22 and Calico 3.7
//! chains), `lab/node6.rules` (the same service on [fd00:10::2]:22) and `lab/node.ipsets`.
//! With [`Mode::Nftables`] kube-proxy runs in nftables mode: its KUBE-* iptables rules are left
//! out and `lab/node-kube-proxy.nft` (tables `ip kube-proxy` and `ip6 kube-proxy`) is loaded.
//! [`Mode::Ipvs`] is the third seed's node: kube-proxy in IPVS mode with Calico, CNI portmap
//! and Docker ([`ipvs`]; it needs a kernel with IP_VS).
//! [`Mode::Bridge`] builds another node: pods on a Linux bridge with br_netfilter ([`bridge`]).
//! With two nodes (`--nodes 2`), two node namespaces joined by a VXLAN overlay ([`overlay`]).

pub mod bridge;
pub mod ipvs;
pub mod overlay;

use std::process::Command;

use anyhow::{Context, Result, bail};

pub const RULES: &str = include_str!("../../../lab/node.rules");
pub const IPSETS: &str = include_str!("../../../lab/node.ipsets");
pub const RULES6: &str = include_str!("../../../lab/node6.rules");
pub const KUBE_PROXY_NFT: &str = include_str!("../../../lab/node-kube-proxy.nft");

/// How kube-proxy programs the lab node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// KUBE-* chains in iptables (kube-proxy's iptables mode).
    #[default]
    Iptables,
    /// Native nftables tables `ip kube-proxy` / `ip6 kube-proxy`, no KUBE-* iptables rules.
    Nftables,
    /// A flannel/kubeadm-style node: pods on the bridge `cni0` (hairpin on, br_netfilter on),
    /// kube-proxy in iptables mode, flannel's rules, a second node for remote endpoints.
    Bridge,
    /// kube-proxy in IPVS mode (kube-ipvs0, virtual services in masquerade mode, its
    /// ipset-based rules) with Calico, a CNI portmap hostport and Docker's chains: the third
    /// seed's node. Needs IP_VS in the kernel.
    Ipvs,
}

/// `iptables-save` text without kube-proxy's chains, rules and jumps (Calico's stay).
pub fn without_kube_proxy(rules: &str) -> String {
    rules
        .lines()
        .filter(|l| !l.contains("KUBE-"))
        .map(|l| format!("{l}\n"))
        .collect()
}

pub const CLUSTER_IP: &str = "10.10.10.2";
pub const CLIENT_IP: &str = "198.51.100.10";
pub const NODE_IP: &str = "198.51.100.1";
pub const NODE_EXT_IP: &str = "203.0.113.1";
pub const POD_IP: &str = "172.17.0.5";
pub const POD2_IP: &str = "192.170.1.5";
pub const EXT_IP: &str = "203.0.113.10";
pub const POD_GW: &str = "169.254.1.1";
pub const CLIENT_IP6: &str = "2001:db8:1::10";
pub const NODE_IP6: &str = "2001:db8:1::1";
pub const POD_IP6: &str = "2001:db8:2::5";
pub const CLUSTER_IP6: &str = "fd00:10::2";

/// Namespace names of one lab instance; `prefix` lets tests run labs side by side.
#[derive(Clone, Debug)]
pub struct Lab {
    pub prefix: String,
    pub mode: Mode,
    /// 2: the two-node overlay lab ([`overlay`]) instead of the single node of `mode`.
    pub nodes: u8,
}

impl Lab {
    pub fn new(prefix: &str) -> Self {
        Self::with_mode(prefix, Mode::Iptables)
    }

    pub fn with_mode(prefix: &str, mode: Mode) -> Self {
        Self {
            prefix: prefix.to_string(),
            mode,
            nodes: 1,
        }
    }

    /// The two-node lab: two nodes joined by a VXLAN overlay ([`overlay`]).
    pub fn two_nodes(prefix: &str) -> Self {
        Self {
            nodes: 2,
            ..Self::new(prefix)
        }
    }

    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    pub fn node(&self) -> String {
        self.ns("node")
    }

    pub const ROLES: [&'static str; 5] = ["client", "node", "pod", "pod2", "ext"];
    /// Every role any mode creates (`down` removes them all, whatever the mode).
    pub const ALL_ROLES: [&'static str; 6] = ["client", "node", "pod", "pod2", "ext", "node2"];

    /// The namespaces this lab's mode creates.
    pub fn roles(&self) -> &'static [&'static str] {
        if self.nodes == 2 {
            return &overlay::ROLES;
        }
        match self.mode {
            Mode::Bridge => &Self::ALL_ROLES,
            Mode::Iptables | Mode::Nftables | Mode::Ipvs => &Self::ROLES,
        }
    }

    /// Whether the lab of this prefix that exists now is a bridge lab (its node has `cni0`):
    /// `lab traffic` sends the flows of the lab that is up, whatever `--mode` says.
    pub fn detect_bridge(&self) -> bool {
        Command::new("ip")
            .args(["-n", &self.node(), "link", "show", bridge::BRIDGE])
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// Whether the lab of this prefix that exists now is the IPVS lab (its node has
    /// `kube-ipvs0`): `lab traffic` sends its flows.
    pub fn detect_ipvs(&self) -> bool {
        Command::new("ip")
            .args(["-n", &self.node(), "link", "show", ipvs::DUMMY])
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// Whether the lab of this prefix that exists now is the two-node lab (a `node2` and no
    /// `client` namespace; the bridge lab has both): `lab traffic` and `lab status` follow the
    /// lab that is up. Read from the namespaces' files, no command that may fail meanwhile.
    pub fn detect_overlay(&self) -> bool {
        let exists = |role: &str| crate::kernel::netns::path(&self.ns(role)).exists();
        exists("node2") && !exists("client")
    }

    /// Builds the lab (removing a previous one of the same prefix first).
    pub fn up(&self) -> Result<()> {
        if self.mode == Mode::Ipvs
            && self.nodes == 1
            && let Some(why) = ipvs::unavailable()
        {
            bail!(why);
        }
        self.down();
        for role in self.roles() {
            run(&["ip", "netns", "add", &self.ns(role)])?;
            self.exec(role, &["ip", "link", "set", "lo", "up"])?;
            // Interfaces created from here on send no IPv6 router solicitations (three, four
            // seconds apart, from every host-like end): traffic nobody asked to see.
            self.exec(
                role,
                &[
                    "sysctl",
                    "-qw",
                    "net.ipv6.conf.default.router_solicitations=0",
                ],
            )?;
        }
        if self.nodes == 2 {
            return overlay::up(self);
        }
        if self.mode == Mode::Bridge {
            return bridge::up(self);
        }
        let node = self.node();
        veth(&node, "cali1a2b", &self.ns("pod"), "eth0")?;
        veth(&node, "cali2c3d", &self.ns("pod2"), "eth0")?;
        self.outside_up(&format!("ip addr add {EXT_IP}/24 dev eth0"))?;
        for (role, ip) in [("pod", POD_IP), ("pod2", POD2_IP)] {
            self.routed_pod_up(role, ip)?;
        }
        self.sh("pod", &format!(
            "ip -6 addr add {POD_IP6}/64 dev eth0 nodad; ip -6 route add default via 2001:db8:2::1"
        ))?;
        self.sh(
            "node",
            &format!(
                "sysctl -qw net.ipv4.ip_forward=1; sysctl -qw net.ipv6.conf.all.forwarding=1; \
             ip addr add {NODE_IP}/24 dev eth0; ip addr add {NODE_EXT_IP}/24 dev eth1; \
             ip -6 addr add {NODE_IP6}/64 dev eth0 nodad; \
             ip addr add {POD_GW}/32 dev cali1a2b; ip addr add {POD_GW}/32 dev cali2c3d; \
             ip -6 addr add 2001:db8:2::1/64 dev cali1a2b nodad; \
             ip route add {POD_IP}/32 dev cali1a2b; ip route add {POD2_IP}/32 dev cali2c3d; \
             ip route add default via {EXT_IP}"
            ),
        )?;
        if self.mode == Mode::Ipvs {
            return ipvs::up(self);
        }
        self.load_rules()
            .context("loading the lab's iptables rules (is the `iptables` package installed?)")?;
        if self.mode == Mode::Nftables {
            pipe(
                &["ip", "netns", "exec", &self.node(), "nft", "-f", "-"],
                KUBE_PROXY_NFT,
            )
            .context(
                "loading kube-proxy's nftables tables (is the `nftables` package installed?)",
            )?;
        }
        Ok(())
    }

    fn load_rules(&self) -> Result<()> {
        let node = self.node();
        pipe(
            &["ip", "netns", "exec", &node, "ipset", "restore", "-exist"],
            IPSETS,
        )?;
        let (v4, v6) = match self.mode {
            Mode::Iptables | Mode::Bridge => (RULES.to_string(), RULES6.to_string()),
            Mode::Nftables => (without_kube_proxy(RULES), without_kube_proxy(RULES6)),
            Mode::Ipvs => (ipvs::RULES.to_string(), ipvs::RULES6.to_string()),
        };
        pipe(&["ip", "netns", "exec", &node, "iptables-restore"], &v4)?;
        pipe(&["ip", "netns", "exec", &node, "ip6tables-restore"], &v6)?;
        Ok(())
    }

    /// Removes every namespace of this lab; missing ones are fine.
    pub fn down(&self) {
        for role in Self::ALL_ROLES {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(role)])
                .output();
        }
    }

    /// Which of the lab's namespaces exist.
    pub fn status(&self) -> Vec<(String, bool)> {
        let existing = Command::new("ip")
            .args(["netns", "list"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let roles = if self.detect_overlay() {
            &overlay::ROLES[..]
        } else if self.detect_bridge() {
            &Self::ALL_ROLES[..]
        } else {
            self.roles()
        };
        roles
            .iter()
            .map(|r| {
                let n = self.ns(r);
                let up = existing
                    .lines()
                    .any(|l| l.split_whitespace().next() == Some(n.as_str()));
                (n, up)
            })
            .collect()
    }

    pub fn exec(&self, role: &str, args: &[&str]) -> Result<String> {
        let ns = self.ns(role);
        let mut full = vec!["ip", "netns", "exec", ns.as_str()];
        full.extend_from_slice(args);
        run(&full)
    }

    pub fn sh(&self, role: &str, script: &str) -> Result<String> {
        self.exec(role, &["sh", "-ec", script])
    }

    /// The node's outside: the client on its eth0 (v4 and v6, routed by the node), and ext
    /// on its eth1, set up by `ext_script`.
    fn outside_up(&self, ext_script: &str) -> Result<()> {
        let node = self.node();
        veth(&node, "eth0", &self.ns("client"), "eth0")?;
        veth(&node, "eth1", &self.ns("ext"), "eth0")?;
        self.sh("ext", ext_script)?;
        self.sh(
            "client",
            &format!(
                "ip addr add {CLIENT_IP}/24 dev eth0; ip route add default via {NODE_IP}; \
                 ip -6 addr add {CLIENT_IP6}/64 dev eth0 nodad; ip -6 route add default via {NODE_IP6}"
            ),
        )?;
        Ok(())
    }

    /// A Calico-style pod (`role`): its /32 address on eth0, routed by the link-local
    /// gateway its node answers for on the veth.
    fn routed_pod_up(&self, role: &str, ip: &str) -> Result<()> {
        self.sh(
            role,
            &format!(
                "ip addr add {ip}/32 dev eth0; ip route add {POD_GW} dev eth0; \
                 ip route add default via {POD_GW}"
            ),
        )?;
        Ok(())
    }
}

fn veth(a: &str, a_if: &str, b: &str, b_if: &str) -> Result<()> {
    run(&[
        "ip", "link", "add", a_if, "netns", a, "type", "veth", "peer", "name", b_if, "netns", b,
    ])?;
    run(&["ip", "-n", a, "link", "set", a_if, "up"])?;
    run(&["ip", "-n", b, "link", "set", b_if, "up"])?;
    Ok(())
}

fn run(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| {
            format!(
                "cannot run `{}`: is it installed? (`cargo xtask setup`)",
                args[0]
            )
        })?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn pipe(args: &[&str], input: &str) -> Result<()> {
    use std::io::Write;
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{}`", args[0]))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nftables_mode_keeps_calico_and_drops_every_kube_rule() {
        for rules in [RULES, RULES6] {
            let kept = without_kube_proxy(rules);
            assert!(!kept.contains("KUBE-"));
            let cali = |t: &str| t.lines().filter(|l| l.contains("cali")).count();
            assert_eq!(cali(&kept), cali(rules));
            assert_eq!(
                kept.matches("COMMIT").count(),
                rules.matches("COMMIT").count()
            );
        }
        // The native tables replace them: both families, the same services.
        assert!(KUBE_PROXY_NFT.contains("table ip kube-proxy"));
        assert!(KUBE_PROXY_NFT.contains("table ip6 kube-proxy"));
        assert!(KUBE_PROXY_NFT.contains(&format!("dnat to {POD_IP}:22")));
    }
}
