//! Lab traffic: small, bounded flows between the lab's namespaces, generated with sockets on
//! threads that joined those namespaces (no external tools, nothing in the root namespace).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::commands::lab::{self, Lab};
use crate::kernel::netns::spawn_in;

const TIMEOUT: Duration = Duration::from_secs(3);

/// Serves `count` TCP connections on `addr` inside `ns`, echoing what each sends. Returns
/// once listening; the server thread stops after `count` connections or `TIMEOUT`.
pub fn tcp_echo_server(
    ns: &str,
    addr: SocketAddr,
    count: usize,
) -> Result<std::thread::JoinHandle<Result<()>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = spawn_in(ns, move || {
        let l = TcpListener::bind(addr).with_context(|| format!("bind {addr}"))?;
        l.set_nonblocking(true)?;
        let _ = tx.send(());
        let deadline = Instant::now() + TIMEOUT;
        let mut served = 0;
        while served < count && Instant::now() < deadline {
            match l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_read_timeout(Some(TIMEOUT))?;
                    let mut buf = [0u8; 1024];
                    let n = s.read(&mut buf).unwrap_or(0);
                    let _ = s.write_all(&buf[..n]);
                    served += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    });
    rx.recv_timeout(TIMEOUT)
        .context("echo server did not start")?;
    Ok(h)
}

/// Connects from `ns` to `to`, sends `msg` and expects it echoed back.
pub fn tcp_roundtrip(ns: &str, to: SocketAddr, msg: &'static [u8]) -> Result<()> {
    spawn_in(ns, move || {
        let mut s =
            TcpStream::connect_timeout(&to, TIMEOUT).with_context(|| format!("connect {to}"))?;
        s.set_read_timeout(Some(TIMEOUT))?;
        s.write_all(msg)?;
        s.shutdown(Shutdown::Write)?;
        let mut back = Vec::new();
        s.read_to_end(&mut back)?;
        if back != msg {
            bail!("echo from {to} returned {back:?}");
        }
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// Sends one UDP datagram from `ns` to `to`.
pub fn udp_send(ns: &str, to: SocketAddr, msg: &'static [u8]) -> Result<()> {
    spawn_in(ns, move || {
        let bind: SocketAddr = if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse()?;
        let s = UdpSocket::bind(bind)?;
        s.send_to(msg, to)?;
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// Waits for an echo server's thread to end, with its result.
fn joined(server: std::thread::JoinHandle<Result<()>>) -> Result<()> {
    server
        .join()
        .map_err(|_| anyhow::anyhow!("server panicked"))?
}

/// One TCP connection from the lab's `client` (role, destination) to an echo server the
/// lab's `server` (role, address) runs for it, echoed back.
fn echoed(
    lab: &Lab,
    server: (&str, SocketAddr),
    client: (&str, SocketAddr),
    msg: &'static [u8],
) -> Result<()> {
    let h = tcp_echo_server(&lab.ns(server.0), server.1, 1)?;
    tcp_roundtrip(&lab.ns(client.0), client.1, msg)?;
    joined(h)
}

/// The demo's flows. Returns a line per flow saying what was sent.
pub fn demo_flows(lab: &Lab) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let svc: SocketAddr = format!("{}:22", lab::CLUSTER_IP).parse()?;
    let pod: SocketAddr = format!("{}:22", lab::POD_IP).parse()?;
    echoed(lab, ("pod", pod), ("client", svc), b"hello registry")?;
    done.push(format!(
        "client -> ClusterIP {svc} (kube-proxy DNAT to {pod}, masquerade)"
    ));

    let ext: SocketAddr = format!("{}:8080", lab::EXT_IP).parse()?;
    echoed(lab, ("ext", ext), ("pod2", ext), b"hello outside")?;
    done.push(format!(
        "pod2 {} -> external {ext} (Calico nat-outgoing)",
        lab::POD2_IP
    ));

    let node: SocketAddr = format!("{}:9", lab::NODE_IP).parse()?;
    udp_send(&lab.ns("client"), node, b"to the node")?;
    done.push(format!(
        "client -> node {node} udp (no socket listens: the kernel drops it after INPUT)"
    ));
    Ok(done)
}

/// The bridge lab's flows (`observer lab up --mode bridge`). Returns a line per flow.
pub fn bridge_flows(lab: &Lab) -> Result<Vec<String>> {
    use crate::commands::lab::bridge as b;
    let mut done = Vec::new();
    let registry: SocketAddr = format!("{}:22", b::REGISTRY_IP).parse()?;
    let pod: SocketAddr = format!("{}:22", b::POD_IP).parse()?;
    let server = tcp_echo_server(&lab.ns("pod"), pod, 3)?;
    tcp_roundtrip(&lab.ns("pod2"), pod, b"hello pod")?;
    done.push(format!(
        "pod2 {} -> pod {pod} (bridged from {} to {})",
        b::POD2_IP,
        b::POD2_PORT,
        b::POD_PORT
    ));
    tcp_roundtrip(&lab.ns("pod2"), registry, b"hello registry")?;
    done.push(format!(
        "pod2 -> ClusterIP {registry} (DNAT to {pod} on the same bridge, then bridged)"
    ));
    tcp_roundtrip(&lab.ns("pod"), registry, b"hello myself")?;
    done.push(format!(
        "pod -> ClusterIP {registry} (DNAT to itself: hairpin, masqueraded)"
    ));
    joined(server)?;

    let remote: SocketAddr = format!("{}:80", b::REMOTE_SVC_IP).parse()?;
    let remote_pod: SocketAddr = format!("{}:80", b::REMOTE_POD_IP).parse()?;
    echoed(lab, ("node2", remote_pod), ("pod2", remote), b"hello node2")?;
    done.push(format!(
        "pod2 -> ClusterIP {remote} (DNAT to {remote_pod} on the other node, routed)"
    ));

    let ext: SocketAddr = format!("{}:8080", lab::EXT_IP).parse()?;
    echoed(lab, ("ext", ext), ("pod", ext), b"hello outside")?;
    done.push(format!("pod -> external {ext} (flannel masquerade)"));

    let denied: SocketAddr = format!("{}:{}", b::POD2_IP, b::DENIED_PORT).parse()?;
    udp_send(&lab.ns("pod"), denied, b"denied")?;
    done.push(format!(
        "pod -> pod2 {denied} udp (the network policy drops it in FORWARD)"
    ));

    // With `--bridge-chains`: frames the nft bridge-family table counts and drops.
    let table: Vec<&str> = b::BRIDGE_TABLE.split(' ').collect();
    if lab
        .exec("node", &[&["nft", "list", "table"][..], &table].concat())
        .is_ok()
    {
        let counted: SocketAddr = format!("{}:{}", b::POD2_IP, b::L2_COUNTED_PORT).parse()?;
        udp_send(&lab.ns("pod"), counted, b"counted")?;
        done.push(format!(
            "pod -> pod2 {counted} udp (counted by `{}`'s prerouting and forward chains)",
            b::BRIDGE_TABLE
        ));
        let l2_denied: SocketAddr = format!("{}:{}", b::POD2_IP, b::L2_DENIED_PORT).parse()?;
        udp_send(&lab.ns("pod"), l2_denied, b"l2 denied")?;
        done.push(format!(
            "pod -> pod2 {l2_denied} udp (dropped by `{}`'s forward chain, before IP FORWARD)",
            b::BRIDGE_TABLE
        ));
    }
    Ok(done)
}

/// The two-node lab's flows (`observer lab up --nodes 2`). Returns a line per flow.
pub fn overlay_flows(lab: &Lab) -> Result<Vec<String>> {
    use crate::commands::lab::overlay as o;
    let mut done = Vec::new();
    let svc: SocketAddr = format!("{}:{}", o::SERVICE_IP, o::SERVICE_PORT).parse()?;
    let endpoint: SocketAddr = format!("{}:{}", o::POD2_IP, o::TARGET_PORT).parse()?;
    echoed(
        lab,
        ("pod2", endpoint),
        ("pod", svc),
        b"hello across the overlay",
    )?;
    done.push(format!(
        "pod {} -> ClusterIP {svc} (DNAT on node to {endpoint}, VXLAN VNI {} over {} to node2)",
        o::POD_IP,
        o::VNI,
        o::UNDERLAY_DEV
    ));

    let pod: SocketAddr = format!("{}:{}", o::POD_IP, o::TARGET_PORT).parse()?;
    echoed(lab, ("pod", pod), ("pod2", pod), b"hello back")?;
    done.push(format!(
        "pod2 {} -> pod {pod} (routed through node2's {} to node)",
        o::POD2_IP,
        o::VXLAN_DEV
    ));

    let denied: SocketAddr = format!("{}:{}", o::SERVICE_IP, o::DENIED_PORT).parse()?;
    udp_send(&lab.ns("pod"), denied, b"denied")?;
    done.push(format!(
        "pod -> ClusterIP {denied} udp (DNAT on node to {}:{}, dropped in node2's FORWARD by the policy)",
        o::POD2_IP,
        o::DENIED_PORT
    ));
    Ok(done)
}

/// Connects from `ns` to `to` and expects no answer (a SYN some rule drops).
fn tcp_unanswered(ns: &str, to: SocketAddr) -> Result<()> {
    spawn_in(ns, move || {
        match TcpStream::connect_timeout(&to, Duration::from_millis(500)) {
            Ok(_) => bail!("{to} answered; the lab's policy should drop it"),
            Err(_) => Ok(()),
        }
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// The IPVS lab's flows (`observer lab up --mode ipvs`). Returns a line per flow.
pub fn ipvs_flows(lab: &Lab) -> Result<Vec<String>> {
    use crate::commands::lab::ipvs as v;
    let mut done = Vec::new();
    let sock = |ip: &str, port: u16| -> Result<SocketAddr> {
        Ok(if ip.contains(':') {
            format!("[{ip}]:{port}")
        } else {
            format!("{ip}:{port}")
        }
        .parse()?)
    };
    let pod22 = sock(lab::POD_IP, 22)?;
    let registry = sock(v::REGISTRY_IP, 22)?;
    echoed(lab, ("pod", pod22), ("client", registry), b"hello registry")?;
    done.push(format!(
        "client -> ClusterIP {registry} (IPVS rr, Masq to the local pod {pod22}; sent through OUTPUT, masqueraded)"
    ));
    let web = sock(v::WEB_IP, 80)?;
    let remote = sock(v::REMOTE_POD_IP, 80)?;
    echoed(lab, ("ext", remote), ("client", web), b"hello node2")?;
    done.push(format!(
        "client -> ClusterIP {web} (IPVS Masq to node2's pod {remote}, out eth1)"
    ));
    let node_port = sock(lab::NODE_IP, v::NODE_PORT)?;
    echoed(
        lab,
        ("pod", pod22),
        ("client", node_port),
        b"hello nodeport",
    )?;
    done.push(format!(
        "client -> NodePort {node_port} (IPVS Masq to {pod22})"
    ));
    let host_port = sock(lab::NODE_IP, v::HOST_PORT)?;
    let pod80 = sock(lab::POD_IP, v::HOST_PORT_TARGET)?;
    echoed(
        lab,
        ("pod", pod80),
        ("client", host_port),
        b"hello hostport",
    )?;
    done.push(format!(
        "client -> hostport {host_port} (CNI portmap DNAT to {pod80}, forwarded: no IPVS)"
    ));
    let dns = sock(v::DNS_IP, 53)?;
    udp_send(&lab.ns("client"), dns, b"dns?")?;
    done.push(format!(
        "client -> ClusterIP {dns} udp (IPVS rr: one of {}:53 and {}:53)",
        lab::POD_IP,
        lab::POD2_IP
    ));
    let telnet = sock(v::TELNET_IP, 23)?;
    tcp_unanswered(&lab.ns("client"), telnet)?;
    done.push(format!(
        "client -> ClusterIP {telnet} (IPVS Masq to {}:23, dropped by Calico's policy in OUTPUT)",
        lab::POD2_IP
    ));
    let pod6 = sock(lab::POD_IP6, 22)?;
    let registry6 = sock(v::CLUSTER_IP6, 22)?;
    echoed(lab, ("pod", pod6), ("client", registry6), b"hello v6")?;
    done.push(format!(
        "client -> ClusterIP {registry6} (IPVS Masq to {pod6})"
    ));
    Ok(done)
}
