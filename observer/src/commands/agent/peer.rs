//! Who may use the streaming API on `--listen` (TCP): root only, told by the connecting
//! socket's owner as the kernel lists it (`/proc/net/tcp`, `tcp6` of the namespace the
//! listener was bound in: opened then, and read again from the start for each request, so
//! that it stays that namespace's table after `--node-netns` moved the agent to the node's).
//! The DaemonSet listens on its pod's own loopback (no `hostNetwork`), which no other pod
//! and no process of the node's namespace can reach; `kubectl observer` arrives through the
//! API server's port-forward, which the container runtime (root) dials inside the pod's
//! namespace, so RBAC decides who gets there. Where the agent listens in a shared namespace
//! (`--netns`, or `hostNetwork`), a non-root process there is refused, whatever it asks
//! (traces, drops, names, the ruleset, arming). The unix socket is mode 0600 (root) already.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::extract::{ConnectInfo, Request};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The kernel's tables of TCP sockets of one namespace: the one the calling thread is in
/// when [`TcpTables::open`] runs (a `/proc` file keeps the namespace it was opened in).
#[derive(Clone)]
pub struct TcpTables {
    tcp: Arc<Mutex<File>>,
    /// None where the kernel has no IPv6.
    tcp6: Option<Arc<Mutex<File>>>,
}

impl TcpTables {
    /// Opens the calling thread's namespace's tables.
    pub fn open() -> std::io::Result<Self> {
        let open = |f: &str| File::open(format!("/proc/thread-self/net/{f}"));
        Ok(Self {
            tcp: Arc::new(Mutex::new(open("tcp")?)),
            tcp6: open("tcp6").ok().map(|f| Arc::new(Mutex::new(f))),
        })
    }

    /// The owner (uid) of the socket at `peer` connected to `ours`, from the table as it is
    /// now; None when no such socket is in this namespace (another host).
    pub fn peer_uid(&self, ours: SocketAddr, peer: SocketAddr) -> Option<u32> {
        let file = if peer.is_ipv4() {
            &self.tcp
        } else {
            self.tcp6.as_ref()?
        };
        let mut f = file.lock().ok()?;
        // A seq file is made anew when read from its start.
        f.seek(SeekFrom::Start(0)).ok()?;
        let mut text = String::new();
        f.read_to_string(&mut text).ok()?;
        uid_in(&text, ours, peer)
    }
}

/// [`peer_uid`] over the text of `/proc/net/tcp[6]`.
fn uid_in(text: &str, ours: SocketAddr, peer: SocketAddr) -> Option<u32> {
    text.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
        let (local, remote, uid) = (f.get(1)?, f.get(2)?, f.get(7)?);
        (parse_addr(local)? == peer && parse_addr(remote)? == ours)
            .then(|| uid.parse().ok())
            .flatten()
    })
}

/// `0100007F:2704` (IPv4, the address as the kernel's u32 in host order, little-endian
/// here) or 32 hex digits for IPv6 (four such u32s), then the port.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (a, p) = s.split_once(':')?;
    let port = u16::from_str_radix(p, 16).ok()?;
    let word = |h: &str| u32::from_str_radix(h, 16).ok().map(u32::from_be);
    let ip = match a.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(a)?.to_be_bytes())),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(&a[i * 8..i * 8 + 8])?.to_be_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The layer on the TCP listener at `ours`: requests from a socket not owned by root are
/// refused with 403 and what to do instead.
pub async fn root_only(
    tables: TcpTables,
    ours: SocketAddr,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    match tables.peer_uid(ours, peer) {
        Some(0) => next.run(req).await,
        who => {
            let who = who.map_or_else(
                || format!("{peer}, not a socket of the agent's namespace,"),
                |uid| format!("uid {uid}"),
            );
            log::info!("streaming API on --listen: refused {who} ({})", req.uri());
            (
                StatusCode::FORBIDDEN,
                format!(
                    "the agent's streaming API on TCP answers root only ({who} is refused): \
                     use `kubectl observer` (the API server's port-forward, as RBAC's \
                     observer-user Role grants), or run as root on the node\n"
                ),
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Two ends of one loopback connection, as /proc/net/tcp lists them (the listener, the
    // agent's accepted socket, and the client's own, uid 65534).
    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:26EF 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0 100 0 0 10 0
   1: 0100007F:26EF 0100007F:B5DA 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0 20 4 30 10 -1
   2: 0100007F:B5DA 0100007F:26EF 01 00000000:00000000 00:00000000 00000000 65534        0 3333 1 0 20 4 30 10 -1
";

    #[test]
    fn the_peer_is_found_by_its_own_end_of_the_connection() {
        let ours: SocketAddr = "127.0.0.1:9967".parse().unwrap();
        let peer: SocketAddr = "127.0.0.1:46554".parse().unwrap();
        assert_eq!(uid_in(TCP, ours, peer), Some(65534));
        // Our own accepted socket is root's, and is not taken for the peer.
        assert_eq!(uid_in(TCP, peer, ours), Some(0));
        assert_eq!(uid_in(TCP, ours, "127.0.0.1:1".parse().unwrap()), None);
    }

    #[test]
    fn a_connection_of_this_namespace_is_found_in_the_tables_opened_before_it() {
        let tables = TcpTables::open().unwrap();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = l.local_addr().unwrap();
        let c = std::net::TcpStream::connect(ours).unwrap();
        let peer = c.local_addr().unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(tables.peer_uid(ours, peer), Some(me));
        // Read again from the start: a second connection is there too.
        let c2 = std::net::TcpStream::connect(ours).unwrap();
        assert_eq!(tables.peer_uid(ours, c2.local_addr().unwrap()), Some(me));
        assert_eq!(tables.peer_uid(ours, "127.0.0.1:1".parse().unwrap()), None);
    }

    #[test]
    fn ipv6_addresses_are_read_word_by_word() {
        assert_eq!(
            parse_addr("00000000000000000000000001000000:26EF"),
            Some("[::1]:9967".parse().unwrap())
        );
        assert_eq!(
            parse_addr("0100007F:0035"),
            Some("127.0.0.1:53".parse().unwrap())
        );
        assert_eq!(parse_addr("xyz:1"), None);
    }
}
