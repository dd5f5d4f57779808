//! The kernel settings (sysctls) that change a routing decision the simulator makes:
//! `net.ipv4.conf.<all|IFACE>.route_localnet`. Read from the node (`--live`: the
//! namespace's `/proc/sys/net/ipv4/conf/*/route_localnet`) or given as `KEY=VALUE` lines;
//! when not given, the kernel's defaults are assumed, and the explanation says so where
//! that assumption decides a packet's fate.

use std::collections::BTreeMap;

use crate::error::ParseError;

/// The settings the simulator uses, and whether they were read or assumed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sysctls {
    /// `route_localnet` by `conf` entry (`all`, `default`, interface names): set means 1.
    route_localnet: BTreeMap<String, bool>,
    /// True when the values came from the node or the user; false: the kernel's defaults
    /// (every `route_localnet` 0) are assumed.
    pub given: bool,
    /// True when they were read from the node ([`Sysctls::read_text`]'s first line).
    pub read: bool,
}

/// The first line of [`Sysctls::read_text`]: the values were read, not given.
const READ_MARK: &str = "# read from the node";

impl Sysctls {
    /// Parses `KEY=VALUE` lines (`sysctl` style, `#` comments and blank lines skipped;
    /// `net/ipv4/...` spelled with slashes too). Only the keys the simulator models are
    /// accepted: any other is an error that says which are.
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let mut s = Sysctls {
            given: true,
            ..Default::default()
        };
        s.read = text.lines().next().is_some_and(|l| l.trim() == READ_MARK);
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let err = |col: usize, what: String| ParseError::new(n + 1, col, what);
            let Some((key, value)) = line.split_once('=') else {
                return Err(err(1, format!("`{line}`: KEY=VALUE expected")));
            };
            let key = key.trim().replace('/', ".");
            let value = value.trim();
            let on = match value {
                "0" => false,
                "1" => true,
                v => {
                    return Err(err(
                        line.find('=').unwrap_or(0) + 2,
                        format!("`{key}`: value `{v}`, 0 or 1 expected"),
                    ));
                }
            };
            let conf = key
                .strip_prefix("net.ipv4.conf.")
                .and_then(|rest| rest.strip_suffix(".route_localnet"))
                .filter(|c| !c.is_empty());
            let Some(conf) = conf else {
                return Err(err(
                    1,
                    format!(
                        "`{key}` is not modelled: only net.ipv4.conf.<all|IFACE>.route_localnet \
                         changes what the simulator decides"
                    ),
                ));
            };
            s.route_localnet.insert(conf.to_string(), on);
        }
        Ok(s)
    }

    /// Whether packets from outside may use 127.0.0.0/8 on `dev`: the kernel's
    /// `IN_DEV_ROUTE_LOCALNET`, `all` or the interface's own setting.
    pub fn route_localnet(&self, dev: &str) -> bool {
        self.route_localnet.get("all").copied().unwrap_or(false)
            || self.route_localnet.get(dev).copied().unwrap_or(false)
    }

    /// How the value used for `dev` is known, for an explanation's note.
    pub fn provenance(&self) -> &'static str {
        if self.read {
            "as read from the node"
        } else if self.given {
            "as given"
        } else {
            "the kernel's default, assumed: the node's sysctls were not read (pass \
             `--sysctl net.ipv4.conf.all.route_localnet=1` if the node sets it)"
        }
    }

    /// The node's settings as `KEY=VALUE` lines: every `route_localnet` under
    /// `/proc/sys/net/ipv4/conf` of the calling thread's network namespace.
    pub fn read_text() -> std::io::Result<String> {
        let mut out = format!("{READ_MARK}\n");
        let mut confs: Vec<String> = std::fs::read_dir("/proc/sys/net/ipv4/conf")?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        confs.sort();
        for c in confs {
            let path = format!("/proc/sys/net/ipv4/conf/{c}/route_localnet");
            if let Ok(v) = std::fs::read_to_string(&path) {
                out.push_str(&format!("net.ipv4.conf.{c}.route_localnet={}\n", v.trim()));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_localnet_is_all_or_the_interface() {
        let s = Sysctls::parse(
            "# node\nnet.ipv4.conf.all.route_localnet = 0\nnet/ipv4/conf/eth1/route_localnet=1\n",
        )
        .unwrap();
        assert!(s.given);
        assert!(s.route_localnet("eth1"));
        assert!(!s.route_localnet("eth0"));
        let all = Sysctls::parse("net.ipv4.conf.all.route_localnet=1").unwrap();
        assert!(all.route_localnet("eth0"));
        assert_eq!(s.provenance(), "as given");
        let read =
            Sysctls::parse(&format!("{READ_MARK}\nnet.ipv4.conf.lo.route_localnet=0\n")).unwrap();
        assert_eq!(read.provenance(), "as read from the node");
        let d = Sysctls::default();
        assert!(!d.given && !d.route_localnet("eth0"));
        assert!(d.provenance().contains("--sysctl"));
    }

    #[test]
    fn other_keys_and_values_are_refused_saying_what_is_modelled() {
        let e = Sysctls::parse("net.ipv4.ip_forward=1").unwrap_err();
        assert!(e.to_string().contains("route_localnet"), "{e}");
        let e = Sysctls::parse("net.ipv4.conf.all.route_localnet=yes").unwrap_err();
        assert!(e.to_string().contains("0 or 1"), "{e}");
        assert!(Sysctls::parse("route_localnet").is_err());
    }
}
