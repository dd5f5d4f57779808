//! Network namespaces and their interfaces: entering a namespace by `ip netns` name or by
//! path (probes attach in the caller's namespace), short jobs on threads inside one, the
//! namespace's inode, and interface names and indexes.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// The file of namespace `name`: an `ip netns` name (`/run/netns/NAME`), or, when it holds
/// a `/`, a path to a namespace file itself (`/proc/1/ns/net`, a bind mount of one).
pub fn path(name: &str) -> PathBuf {
    if name.contains('/') {
        PathBuf::from(name)
    } else {
        PathBuf::from("/run/netns").join(name)
    }
}

/// Moves the calling thread into namespace `name` (an `ip netns` name or a path, as
/// [`path`]). Call before starting other threads when the whole process should live there.
pub fn enter(name: &str) -> Result<()> {
    let p = path(name);
    let f = File::open(&p).with_context(|| {
        if name.contains('/') {
            format!(
                "cannot open the network namespace file {} (a bind mount of a namespace, or \
                 /proc/PID/ns/net: opening another process's needs CAP_SYS_PTRACE)",
                p.display()
            )
        } else {
            format!(
                "no network namespace `{name}` ({} missing; see `ip netns list`)",
                p.display()
            )
        }
    })?;
    // SAFETY: setns on a namespace fd we own; it changes only this thread's namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!(
            "cannot enter network namespace `{name}`: {} (run as root: setns needs \
             CAP_SYS_ADMIN)",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Runs `f` on a new thread inside namespace `name`.
pub fn spawn_in<F, R>(name: &str, f: F) -> std::thread::JoinHandle<Result<R>>
where
    F: FnOnce() -> Result<R> + Send + 'static,
    R: Send + 'static,
{
    let name = name.to_string();
    std::thread::spawn(move || {
        enter(&name)?;
        f()
    })
}

/// Inode of the calling thread's network namespace: what `net.ns.inum` holds in the kernel.
pub fn current_netns_inode() -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(std::fs::metadata("/proc/thread-self/ns/net")
        .context("reading /proc/thread-self/ns/net")?
        .ino())
}

/// Interfaces of the current network namespace (index, name).
pub fn interfaces() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    // SAFETY: if_nameindex returns a list terminated by a zero entry, freed below.
    unsafe {
        let list = libc::if_nameindex();
        if list.is_null() {
            return out;
        }
        let mut p = list;
        while (*p).if_index != 0 {
            let name = std::ffi::CStr::from_ptr((*p).if_name)
                .to_string_lossy()
                .into_owned();
            out.push(((*p).if_index, name));
            p = p.add(1);
        }
        libc::if_freenameindex(list);
    }
    out
}

/// Whether interface `name` of the current namespace is a Linux bridge: its driver, as
/// ethtool reports it (`ETHTOOL_GDRVINFO`), is "bridge". Read once per new interface; the
/// sysfs view (`/sys/class/net/NAME/bridge`) would be the mounting namespace's, not ours.
pub fn is_bridge(name: &str) -> bool {
    driver(name).is_some_and(|d| d == "bridge")
}

/// The VXLAN device of the current namespace with network identifier `vni` on UDP `port`
/// (`flannel.1`, `vxlan.calico`), as `ip -details link` reports them; None when there is
/// none or `ip` cannot say. Run from the thread that joined the observed namespace (a child
/// process starts in its namespace).
pub fn vxlan_device(vni: u32, port: u16) -> Option<String> {
    let out = std::process::Command::new("ip")
        .args(["-details", "-json", "link", "show", "type", "vxlan"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    vxlan_device_in(&String::from_utf8_lossy(&out.stdout), vni, port)
}

/// [`vxlan_device`] over `ip -details -json link` output.
pub fn vxlan_device_in(json: &str, vni: u32, port: u16) -> Option<String> {
    let links: Vec<serde_json::Value> = serde_json::from_str(json).ok()?;
    links.iter().find_map(|l| {
        let info = l.get("linkinfo")?;
        // Geneve's data has an id and a port too.
        if info.get("info_kind")?.as_str()? != "vxlan" {
            return None;
        }
        let data = info.get("info_data")?;
        let id = data.get("id")?.as_u64()?;
        let p = data.get("port")?.as_u64()?;
        (id == u64::from(vni) && p == u64::from(port))
            .then(|| l.get("ifname")?.as_str().map(str::to_string))
            .flatten()
    })
}

/// The driver of interface `name` (`ETHTOOL_GDRVINFO`), None where the ioctl fails.
fn driver(name: &str) -> Option<String> {
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    /// `struct ethtool_drvinfo` (linux/ethtool.h): the driver name comes first.
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 160],
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IF_NAMESIZE],
        data: *mut DrvInfo,
        _pad: [u8; 16],
    }
    if name.len() >= libc::IF_NAMESIZE {
        return None;
    }
    let mut info = DrvInfo {
        cmd: ETHTOOL_GDRVINFO,
        driver: [0; 32],
        rest: [0; 160],
    };
    let mut req = IfReq {
        name: [0; libc::IF_NAMESIZE],
        data: &mut info,
        _pad: [0; 16],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: a datagram socket of the current namespace, closed below; SIOCETHTOOL reads
    // the ifreq (a NUL-terminated name and a pointer to a drvinfo the kernel fills, both
    // alive for the call).
    let ok = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let r = libc::ioctl(fd, libc::SIOCETHTOOL as _, &mut req as *mut IfReq);
        libc::close(fd);
        r == 0
    };
    if !ok {
        return None;
    }
    let end = info.driver.iter().position(|&b| b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// Index of interface `name` in the current namespace.
pub fn ifindex(name: &str) -> Option<u32> {
    let c = std::ffi::CString::new(name).ok()?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (i != 0).then_some(i)
}

/// Name of an interface in the current namespace, or `if<N>` if it is gone.
pub fn ifname(index: u32) -> String {
    if index == 0 {
        return "-".into();
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: buf has IF_NAMESIZE bytes as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if p.is_null() {
        return format!("if{index}");
    }
    // SAFETY: on success buf holds a NUL-terminated name.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod vxlan_tests {
    use super::vxlan_device_in;

    #[test]
    fn the_vxlan_device_is_found_by_vni_and_port() {
        // `ip -details -json link show type vxlan`, trimmed (iproute2 6.1).
        let json = r#"[{"ifindex":5,"ifname":"vxlan.calico","linkinfo":{"info_kind":"vxlan","info_data":{"id":4096,"port":4789}}},
            {"ifindex":6,"ifname":"flannel.1","linkinfo":{"info_kind":"vxlan","info_data":{"id":1,"local":"192.168.60.1","port":4789}}}]"#;
        assert_eq!(vxlan_device_in(json, 1, 4789).as_deref(), Some("flannel.1"));
        assert_eq!(
            vxlan_device_in(json, 4096, 4789).as_deref(),
            Some("vxlan.calico")
        );
        assert_eq!(vxlan_device_in(json, 1, 8472), None);
        assert_eq!(vxlan_device_in("not json", 1, 4789), None);
    }
}
