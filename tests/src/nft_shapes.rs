//! Generators for the nftables differential test (`tests/tests/nft_differential.rs`):
//! kube-proxy-nftables-shaped rulesets (`ip` and `ip6`, pkg/proxy/nftables) and
//! Calico-nftables-shaped ones (felix/nftables) as `nft -f` text, and the probes that exercise
//! them. Deterministic for a seed, so a failure replays.

use std::fmt::Write as _;
use std::net::IpAddr;

use observer_rules::PacketSpec;

/// xorshift64*, as in `rules_differential`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng((seed ^ 0xd1b5_4a32_d192_ed03).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Probe {
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    /// Sent by the router itself (OUTPUT) rather than by the client (PREROUTING).
    pub local_out: bool,
}

impl Probe {
    pub fn spec(&self, sport: u16) -> PacketSpec {
        PacketSpec {
            in_iface: (!self.local_out).then(|| "calir0".to_string()),
            ..PacketSpec::new(
                self.proto,
                self.src,
                Some(sport),
                self.dst,
                Some(self.dport),
            )
        }
    }
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

// ---- kube-proxy (pkg/proxy/nftables) shaped rulesets ----

/// What differs between `ip kube-proxy` and `ip6 kube-proxy` rulesets and their probes.
pub struct Fam {
    pub v6: bool,
}

impl Fam {
    /// `ip` / `ip6`: the table family and the payload protocol of addresses.
    fn nft(&self) -> &'static str {
        if self.v6 { "ip6" } else { "ip" }
    }
    fn addr_type(&self) -> &'static str {
        if self.v6 { "ipv6_addr" } else { "ipv4_addr" }
    }
    fn cluster_ip(&self, i: usize) -> String {
        if self.v6 {
            format!("fd00:30::{:x}", i + 1)
        } else {
            format!("172.30.{}.{}", i / 200, i % 200 + 1)
        }
    }
    fn cluster_range(&self) -> &'static str {
        if self.v6 {
            "fd00:30::/64"
        } else {
            "172.30.0.0/16"
        }
    }
    fn unallocated(&self) -> &'static str {
        if self.v6 {
            "fd00:30::ff:9"
        } else {
            "172.30.250.9"
        }
    }
    fn lb_ip(&self, i: usize) -> String {
        if self.v6 {
            format!("fd00:56::{:x}", i + 1)
        } else {
            format!("5.6.{}.{}", i / 200, i % 200 + 1)
        }
    }
    fn endpoint(&self, i: usize, e: usize) -> String {
        if self.v6 {
            format!("fd00:180:{:x}::{}", i % 250, e + 1)
        } else {
            format!("10.180.{}.{}", i % 250, e + 1)
        }
    }
    fn pods(&self) -> &'static str {
        if self.v6 {
            "fd00:180::/32"
        } else {
            "10.180.0.0/16"
        }
    }
    fn with_port(&self, a: &str, port: u16) -> String {
        if self.v6 {
            format!("[{a}]:{port}")
        } else {
            format!("{a}:{port}")
        }
    }
    fn loopback(&self) -> &'static str {
        if self.v6 { "::1" } else { "127.0.0.0/8" }
    }
    fn node_ips(&self) -> [&'static str; 2] {
        if self.v6 {
            ["fd00:201::1", "fd00:202::1"]
        } else {
            ["10.201.0.1", "10.202.0.1"]
        }
    }
    fn router_src(&self) -> &'static str {
        self.node_ips()[1]
    }
    /// The client with pre-filled session affinity, then other sources.
    fn clients(&self) -> [&'static str; 5] {
        if self.v6 {
            [
                "fd00:201::7",
                "2001:db8:5100::10",
                "2001:db8:113::5",
                "2001:db8:113:1::200",
                "fd00:180:1::1",
            ]
        } else {
            [
                "10.201.0.7",
                "198.51.100.10",
                "203.0.113.5",
                "203.0.113.200",
                "10.180.1.1",
            ]
        }
    }
    fn source_ranges(&self) -> [&'static str; 3] {
        if self.v6 {
            [
                "2001:db8:113::/64",
                "2001:db8:113::/64, fd00:201::/64",
                "2001:db8:5100::/48",
            ]
        } else {
            [
                "203.0.113.0/25",
                "203.0.113.0/25, 10.201.0.0/24",
                "198.51.100.0/24",
            ]
        }
    }
}

pub static V4: Fam = Fam { v6: false };
pub static V6: Fam = Fam { v6: true };

pub struct Service {
    cluster_ip: String,
    proto: &'static str,
    port: u16,
    node_port: Option<u16>,
    lb_ip: Option<String>,
}

fn hash8(i: usize, salt: u64) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut h = (i as u64 ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..8)
        .map(|_| {
            let c = A[(h & 31) as usize] as char;
            h >>= 5;
            c
        })
        .collect()
}

/// A kube-proxy nftables ruleset with `n` services of random kinds, plus the services.
pub fn kube_proxy(rng: &mut Rng, n: usize, seed_salt: u64, f: &Fam) -> (String, Vec<Service>) {
    let ip = f.nft();
    let pods = f.pods();
    let mut chains = String::new();
    let mut service_ips = Vec::new();
    let mut nodeports = Vec::new();
    let mut no_ep = Vec::new();
    let mut no_ep_np = Vec::new();
    let mut firewall = Vec::new();
    let mut cluster_ips = Vec::new();
    let mut sets = String::new();
    let mut services = Vec::new();
    for i in 0..n {
        let ns = format!("ns{}", i % 3);
        let name = format!("svc{i}");
        let (proto, port) = *rng.pick(&[("tcp", 80u16), ("udp", 53), ("tcp", 443), ("tcp", 8080)]);
        let pname = if port == 53 {
            "dns".to_string()
        } else {
            format!("p{port}")
        };
        let id = format!("{ns}/{name}/{proto}/{pname}");
        let h = hash8(i, seed_salt);
        let cip = f.cluster_ip(i);
        cluster_ips.push(cip.clone());
        let kind = rng.below(4); // 0,1 ClusterIP, 2 NodePort, 3 LoadBalancer
        let node_port = (kind >= 2).then_some(30000 + i as u16);
        let lb_ip = (kind == 3).then(|| f.lb_ip(i));
        let n_ep = *rng.pick(&[0usize, 1, 2, 3]);
        let affinity = rng.chance(30);
        let local = kind >= 2 && rng.chance(40);
        let svc_chain = format!("service-{h}-{id}");
        let ext_chain = format!("external-{h}-{id}");
        // (chain, address, address:port); nft 1.0.6 takes no `:` in chain names.
        let eps: Vec<(String, String, String)> = (0..n_ep)
            .map(|e| {
                let a = f.endpoint(i, e);
                let tp = if rng.chance(50) { port } else { 8080 };
                (
                    format!(
                        "endpoint-{}-{id}__{}/{tp}",
                        hash8(i * 7 + e, seed_salt ^ 1),
                        a.replace(':', "-")
                    ),
                    a.clone(),
                    f.with_port(&a, tp),
                )
            })
            .collect();
        if eps.is_empty() {
            no_ep.push(format!(
                "{cip} . {proto} . {port} comment \"{ns}/{name}:{pname}\" : goto reject-chain"
            ));
            if let Some(np) = node_port {
                no_ep_np.push(format!("{proto} . {np} : goto reject-chain"));
            }
            if let Some(lb) = &lb_ip {
                no_ep.push(format!("{lb} . {proto} . {port} : goto reject-chain"));
            }
        } else {
            service_ips.push(format!("{cip} . {proto} . {port} : goto {svc_chain}"));
            let _ = writeln!(chains, "\tchain {svc_chain} {{");
            let _ = writeln!(
                chains,
                "\t\t{ip} daddr {cip} {proto} dport {port} {ip} saddr != {pods} jump mark-for-masquerade"
            );
            if affinity {
                for (ep, _, _) in &eps {
                    let _ = writeln!(chains, "\t\t{ip} saddr @affinity-{ep} goto {ep}");
                }
            }
            let vm: Vec<String> = eps
                .iter()
                .enumerate()
                .map(|(k, (ep, _, _))| format!("{k} : goto {ep}"))
                .collect();
            let _ = writeln!(
                chains,
                "\t\tnumgen random mod {} vmap {{ {} }}\n\t}}",
                eps.len(),
                vm.join(", ")
            );
            for (ep, a, addr) in &eps {
                let _ = writeln!(chains, "\tchain {ep} {{");
                let _ = writeln!(chains, "\t\t{ip} saddr {a} jump mark-for-masquerade");
                if affinity {
                    let _ = writeln!(chains, "\t\tupdate @affinity-{ep} {{ {ip} saddr }}");
                    // Some clients already have affinity, as after earlier connections.
                    let pre = if rng.chance(40) {
                        format!("\t\telements = {{ {} }}\n", f.clients()[0])
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        sets,
                        "\tset affinity-{ep} {{\n\t\ttype {}\n\t\tflags dynamic,timeout\n\t\ttimeout 3h\n{pre}\t}}",
                        f.addr_type()
                    );
                }
                let _ = writeln!(chains, "\t\tmeta l4proto {proto} dnat to {addr}\n\t}}");
            }
            if node_port.is_some() || lb_ip.is_some() {
                let _ = writeln!(chains, "\tchain {ext_chain} {{");
                if local {
                    let _ = writeln!(
                        chains,
                        "\t\t{ip} saddr {pods} goto {svc_chain} comment \"short-circuit pod traffic\""
                    );
                    let _ = writeln!(
                        chains,
                        "\t\tfib saddr type local jump mark-for-masquerade comment \"masquerade local traffic\""
                    );
                    let _ = writeln!(
                        chains,
                        "\t\tfib saddr type local goto {svc_chain} comment \"short-circuit local traffic\""
                    );
                    let lchain = format!("endpoints-local-{h}-{id}");
                    let _ = writeln!(chains, "\t\tgoto {lchain}\n\t}}");
                    // Only the first endpoint runs on this node.
                    let _ = writeln!(
                        chains,
                        "\tchain {lchain} {{\n\t\tnumgen random mod 1 vmap {{ 0 : goto {} }}\n\t}}",
                        eps[0].0
                    );
                } else {
                    let _ = writeln!(
                        chains,
                        "\t\tjump mark-for-masquerade\n\t\tgoto {svc_chain}\n\t}}"
                    );
                }
                if let Some(np) = node_port {
                    nodeports.push(format!("{proto} . {np} : goto {ext_chain}"));
                }
                if let Some(lb) = &lb_ip {
                    service_ips.push(format!("{lb} . {proto} . {port} : goto {ext_chain}"));
                }
            }
        }
        if let Some(lb) = &lb_ip
            && rng.chance(60)
        {
            let fw = format!("firewall-{h}-{id}");
            let ranges = *rng.pick(&f.source_ranges());
            let _ = writeln!(
                chains,
                "\tchain {fw} {{\n\t\t{ip} saddr != {{ {ranges} }} drop\n\t}}"
            );
            firewall.push(format!("{lb} . {proto} . {port} : goto {fw}"));
        }
        services.push(Service {
            cluster_ip: cip,
            proto,
            port,
            node_port,
            lb_ip,
        });
    }
    let elems = |v: &[String]| {
        if v.is_empty() {
            String::new()
        } else {
            format!("\t\telements = {{ {} }}\n", v.join(", "))
        }
    };
    let fib_nodeports = rng.chance(50);
    let at = f.addr_type();
    let mut t = format!("table {ip} kube-proxy {{\n\tcomment \"rules for kube-proxy\"\n");
    let _ = write!(
        t,
        "\tset cluster-ips {{\n\t\ttype {at}\n{}\t}}\n\tset nodeport-ips {{\n\t\ttype {at}\n\t\telements = {{ {} }}\n\t}}\n",
        elems(&cluster_ips),
        f.node_ips().join(", ")
    );
    let key3 = format!("{at} . inet_proto . inet_service");
    for (name, key, v) in [
        ("service-ips", key3.as_str(), &service_ips),
        ("service-nodeports", "inet_proto . inet_service", &nodeports),
        ("no-endpoint-services", key3.as_str(), &no_ep),
        (
            "no-endpoint-nodeports",
            "inet_proto . inet_service",
            &no_ep_np,
        ),
        ("firewall-ips", key3.as_str(), &firewall),
    ] {
        let _ = write!(
            t,
            "\tmap {name} {{\n\t\ttype {key} : verdict\n{}\t}}\n",
            elems(v)
        );
    }
    t.push_str(&sets);
    let fixed = String::from(
        "\tchain filter-prerouting-pre-dnat {\n\t\ttype filter hook prerouting priority -110; policy accept;\n\t\tct state new jump firewall-check\n\t}
\tchain filter-output-pre-dnat {\n\t\ttype filter hook output priority -110; policy accept;\n\t\tct state new jump firewall-check\n\t}
\tchain filter-input {\n\t\ttype filter hook input priority 0; policy accept;\n\t\tct state new jump nodeport-endpoints-check\n\t\tct state new jump service-endpoints-check\n\t}
\tchain filter-forward {\n\t\ttype filter hook forward priority 0; policy accept;\n\t\tct state new jump service-endpoints-check\n\t\tct state new jump cluster-ips-check\n\t}
\tchain filter-output {\n\t\ttype filter hook output priority 0; policy accept;\n\t\tct state new jump service-endpoints-check\n\t}
\tchain filter-output-post-dnat {\n\t\ttype filter hook output priority -90; policy accept;\n\t\tct state new jump cluster-ips-check\n\t}
\tchain nat-prerouting {\n\t\ttype nat hook prerouting priority -100; policy accept;\n\t\tjump services\n\t}
\tchain nat-output {\n\t\ttype nat hook output priority -100; policy accept;\n\t\tjump services\n\t}
\tchain nat-postrouting {\n\t\ttype nat hook postrouting priority 100; policy accept;\n\t\tjump masquerading\n\t}
\tchain firewall-check {\n\t\tip daddr . meta l4proto . th dport vmap @firewall-ips\n\t}
\tchain reject-chain {\n\t\treject\n\t}
\tchain cluster-ips-check {\n\t\tip daddr @cluster-ips reject comment \"Reject traffic to invalid ports of ClusterIPs\"\n\t\tip daddr { 172.30.0.0/16 } drop comment \"Drop traffic to unallocated ClusterIPs\"\n\t}
\tchain nodeport-endpoints-check {\n\t\tip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports\n\t}
\tchain service-endpoints-check {\n\t\tip daddr . meta l4proto . th dport vmap @no-endpoint-services\n\t}
\tchain mark-for-masquerade {\n\t\tmark set mark or 0x4000\n\t}
\tchain masquerading {\n\t\tmark and 0x4000 == 0 return\n\t\tmark set mark xor 0x4000\n\t\tmasquerade fully-random\n\t}
\tchain services {\n\t\tip daddr . meta l4proto . th dport vmap @service-ips\n",
    );
    t.push_str(
        &fixed
            .replace("ip daddr", &format!("{ip} daddr"))
            .replace("172.30.0.0/16", f.cluster_range()),
    );
    if fib_nodeports {
        let _ = writeln!(
            t,
            "\t\tfib daddr type local {ip} daddr != {} meta l4proto . th dport vmap @service-nodeports\n\t}}",
            f.loopback()
        );
    } else {
        let _ = writeln!(
            t,
            "\t\t{ip} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports\n\t}}"
        );
    }
    t.push_str(&chains);
    t.push_str("}\n");
    (t, services)
}

pub fn kube_proxy_probes(rng: &mut Rng, services: &[Service], count: usize, f: &Fam) -> Vec<Probe> {
    let srcs = f.clients();
    let mut out = Vec::new();
    for _ in 0..count {
        let s = rng.pick(services);
        let proto = if s.proto == "tcp" { 6 } else { 17 };
        let local_out = rng.chance(20);
        let src = if local_out {
            f.router_src()
        } else {
            *rng.pick(&srcs)
        };
        let (dst, dport, proto) = match rng.below(6) {
            0 | 1 => (s.cluster_ip.clone(), s.port, proto),
            2 => (s.cluster_ip.clone(), s.port + 1, proto),
            3 => match s.node_port {
                Some(np) if !local_out => (rng.pick(&f.node_ips()).to_string(), np, proto),
                _ => (s.cluster_ip.clone(), s.port, 23 - proto),
            },
            4 => match &s.lb_ip {
                Some(lb) => (lb.clone(), s.port, proto),
                None => (f.unallocated().to_string(), 80, 6),
            },
            _ => (f.endpoint(3, 2), 8080, proto),
        };
        out.push(Probe {
            proto,
            src: ip(src),
            dst: ip(&dst),
            dport,
            local_out,
        });
    }
    out
}

// ---- Calico (felix/nftables) shaped rulesets ----

/// A Calico nftables ruleset; the mark bits come from a random allocation in 0xffff0000.
pub fn calico(rng: &mut Rng) -> String {
    let bits: Vec<u32> = (16..32).map(|b| 1u32 << b).collect();
    let accept = *rng.pick(&bits);
    let mut pass = *rng.pick(&bits);
    while pass == accept {
        pass = *rng.pick(&bits);
    }
    let scratch = *rng.pick(&bits);
    let pools = *rng.pick(&["10.180.0.0/16", "10.180.0.0/17, 10.180.128.0/17"]);
    let ports = *rng.pick(&["22, 80-90, 443", "8000-8099", "53, 8080"]);
    let svc_port = *rng.pick(&["22", "8080", "1000-2000"]);
    let mut r = String::new();
    let _ = write!(
        r,
        "table ip calico {{
\tset cali40all-ipam-pools {{\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = {{ {pools} }}\n\t}}
\tset cali40all-hosts-net {{\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = {{ 10.202.0.0/24 }}\n\t}}
\tset cali40s-svc {{\n\t\ttype ipv4_addr . inet_proto . inet_service\n\t\tflags interval\n\t\telements = {{ 10.202.0.2 . tcp . {svc_port}, 10.180.0.0/16 . udp . 53, 10.180.3.3 . tcp . 8000-8099 }}\n\t}}
\tset cali40s-pairs {{\n\t\ttype ipv4_addr . ipv4_addr\n\t\tflags interval\n\t\telements = {{ 198.51.100.0/24 . 10.180.3.3, 203.0.113.0/24 . 10.202.0.0/24 }}\n\t}}
\tmap cali-from-wl-dispatch {{\n\t\ttype ifname : verdict\n\t\telements = {{ \"calir0\" : goto filter-cali-fw-calir0 }}\n\t}}
\tmap cali-to-wl-dispatch {{\n\t\ttype ifname : verdict\n\t\telements = {{ \"calir0\" : goto filter-cali-tw-calir0 }}\n\t}}
\tchain raw-PREROUTING {{
\t\ttype filter hook prerouting priority raw; policy accept;
\t\tmeta mark set meta mark & {:#x} comment \"cali:clear\"
\t\tiifname \"calir0\" meta mark set meta mark | {scratch:#x} comment \"cali:from-wl\"
\t\tmeta mark & {scratch:#x} == {scratch:#x} fib saddr . mark . iif oif 0 drop comment \"cali:rpf\"
\t\tiifname \"ethr1\" ip daddr @cali40all-hosts-net return comment \"cali:host\"
\t}}
\tchain raw-OUTPUT {{
\t\ttype filter hook output priority raw; policy accept;
\t\tmeta mark set meta mark & {:#x} comment \"cali:out-clear\"
\t}}
\tchain mangle-PREROUTING {{
\t\ttype filter hook prerouting priority mangle; policy accept;
\t\tct state established,related accept comment \"cali:est\"
\t\tmeta mark & {scratch:#x} == {scratch:#x} ct mark set ct mark | 0x00100000 comment \"cali:ctm\"
\t}}
\tchain filter-FORWARD {{
\t\ttype filter hook forward priority filter; policy accept;
\t\tct state invalid drop comment \"cali:inv\"
\t\tct state established,related accept comment \"cali:fwd-est\"
\t\tmeta mark set meta mark & {:#x} comment \"cali:clr\"
\t\tiifname vmap @cali-from-wl-dispatch comment \"cali:from\"
\t\toifname vmap @cali-to-wl-dispatch comment \"cali:to\"
\t\tmeta mark & {pass:#x} == {pass:#x} accept comment \"cali:pass\"
\t\toifname \"ethr1\" ip daddr @cali40all-ipam-pools meta l4proto {{ tcp, udp }} counter comment \"cali:to-pool\"
\t}}
\tchain filter-OUTPUT {{
\t\ttype filter hook output priority filter; policy accept;
\t\tct state established,related accept
\t\tip daddr . meta l4proto . th dport @cali40s-svc meta mark set meta mark | {accept:#x} comment \"cali:out-svc\"
\t\tmeta mark & {accept:#x} == {accept:#x} accept
\t\toifname \"ethr1\" tcp dport {{ {ports} }} drop comment \"cali:out-deny\"
\t}}
\tchain filter-cali-fw-calir0 {{
\t\tip saddr != @cali40all-ipam-pools ip saddr != {{ 198.51.100.0/24, 203.0.113.0/24 }} drop comment \"cali:spoof\"
\t\tip daddr . meta l4proto . th dport @cali40s-svc meta mark set meta mark | {pass:#x} return comment \"cali:svc\"
\t\tip saddr . ip daddr @cali40s-pairs meta mark set meta mark | {pass:#x} return comment \"cali:pair\"
\t\ttcp dport {{ {ports} }} ct status dnat meta mark set meta mark | {pass:#x} return comment \"cali:dnat\"
\t\tmeta l4proto udp udp dport != 53 reject comment \"cali:udp\"
\t\tdrop comment \"cali:deny\"
\t}}
\tchain filter-cali-tw-calir0 {{
\t\tip saddr @cali40all-hosts-net accept
\t\tdrop
\t}}
\tchain nat-PREROUTING {{
\t\ttype nat hook prerouting priority dstnat; policy accept;
\t\tip daddr 10.96.0.10 udp dport 53 dnat to 10.180.3.3:53 comment \"cali:dns\"
\t\tip daddr 10.96.0.20 tcp dport 80 dnat to 10.180.3.3:8080 comment \"cali:web\"
\t}}
\tchain nat-OUTPUT {{
\t\ttype nat hook output priority -100; policy accept;
\t\tip daddr 10.96.0.20 tcp dport 80 dnat to 10.180.3.3:8080 comment \"cali:out-web\"
\t}}
\tchain nat-POSTROUTING {{
\t\ttype nat hook postrouting priority srcnat; policy accept;
\t\tip saddr @cali40all-ipam-pools ip daddr != @cali40all-ipam-pools masquerade fully-random comment \"cali:masq\"
\t\tct status dnat ip daddr 10.180.3.3 tcp dport 8080 snat to 10.202.0.1 comment \"cali:hairpin\"
\t}}
}}
",
        !(accept | pass | scratch),
        !(accept | pass | scratch),
        !pass,
    );
    r
}

pub fn calico_probes(rng: &mut Rng, count: usize) -> Vec<Probe> {
    let srcs = [
        "10.180.0.9",
        "10.180.200.9",
        "198.51.100.10",
        "203.0.113.5",
        "10.202.0.9",
        "10.201.0.7",
    ];
    let dsts: &[(&str, u16, u8)] = &[
        ("10.96.0.10", 53, 17),
        ("10.96.0.20", 80, 6),
        ("10.180.3.3", 8050, 6),
        ("10.180.3.3", 8080, 6),
        ("10.180.3.3", 53, 17),
        ("10.180.3.3", 99, 17),
        ("10.202.0.2", 22, 6),
        ("10.202.0.2", 1500, 6),
        ("10.202.0.7", 443, 6),
        ("10.202.0.7", 85, 6),
    ];
    (0..count)
        .map(|_| {
            let local_out = rng.chance(20);
            let &(d, port, proto) = rng.pick(dsts);
            let src: &str = if local_out {
                "10.202.0.1"
            } else {
                rng.pick::<&str>(&srcs)
            };
            Probe {
                proto,
                src: ip(src),
                dst: ip(d),
                dport: port,
                local_out,
            }
        })
        .collect()
}
