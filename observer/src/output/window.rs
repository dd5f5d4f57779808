//! Capture windows: what a running agent streamed for a bounded time (`observer tail
//! --agent ADDR --record FILE --timeout N`), or its flight recorder (`observer drops --agent
//! ADDR --record FILE`), with the node's ruleset read through the agent (`GET /v1/ruleset`)
//! when the window opened, so that `observer whatif --recording FILE` holds it against a
//! changed ruleset with no `--old` (docs/whatif.md).
//!
//! The file is NDJSON: a header line `{"observer_window": {...}}` ([`Header`]), then the
//! agent's reports exactly as it streamed them (schema 3, `docs/json-schema.md`), then
//! `{"observer_window_end": {...}}` ([`End`]): how the window ended and what it missed. A
//! window without its end line was cut short, and is read with a warning.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use observer_rules::LiveTexts;
use serde::{Deserialize, Serialize};

/// The format this observer writes and reads.
pub const FORMAT: u32 = 1;

/// What the window is of, and the node's rules.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Header {
    pub format: u32,
    /// The observer version that wrote it.
    pub observer: String,
    /// `traces` (the agent's traversals while the window was open) or `drops` (its flight
    /// recorder: drops it held when the window was fetched).
    pub source: String,
    /// The agent's address as given (a socket path, HOST:PORT), or `kubectl` for the plugin.
    pub agent: String,
    /// The node, when known (`kubectl observer record`).
    pub node: Option<String>,
    /// The filter the agent applied.
    pub filter: Option<String>,
    /// When the window opened, seconds since the epoch.
    pub opened: u64,
    /// The node's rules, sets, routes, addresses and bridge state as the agent read them
    /// when the window opened (`GET /v1/ruleset`).
    pub ruleset: LiveTexts,
    /// The reads of the node that failed there (what they leave out is undecidable).
    #[serde(default)]
    pub ruleset_failures: Vec<String>,
}

/// How the window ended.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct End {
    /// Seconds since the epoch.
    pub closed: u64,
    /// Reports written.
    pub reports: u64,
    /// Traversals the agent could not send (this client read too slowly): not in the window.
    pub skipped: u64,
    /// The agent's closing line (`end`, `sent`, `filtered`, `lost`), when it came.
    pub agent_end: Option<serde_json::Value>,
    /// Who ended the window.
    pub stopped_by: String,
    /// Whether the node's rules (counters left out) differed when the window closed:
    /// then the reports after the change met other rules than the header's.
    #[serde(default)]
    pub ruleset_changed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    #[error("cannot read the capture window {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write the capture window {path}: {source}; check the path and free space")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{0} is not a capture window (its first line is not {{\"observer_window\": ...}}); \
         make one with `observer tail --agent ADDR --record FILE --timeout N`"
    )]
    NotAWindow(String),
    #[error(
        "{path} is a capture window of format {found}; this observer ({version}) reads format \
         {FORMAT}: read it with the observer version that wrote it"
    )]
    UnsupportedFormat {
        path: String,
        found: u32,
        version: &'static str,
    },
    #[error("{path}: line {line}: {what}; the file is damaged")]
    Corrupt {
        path: String,
        line: u64,
        what: String,
    },
}

/// Whether `path` starts as a capture window does (JSON), not as a recording (its magic).
pub fn is_window(path: &Path) -> Result<bool, WindowError> {
    let mut first = [0u8; 1];
    let mut f = std::fs::File::open(path).map_err(|source| WindowError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let n = f.read(&mut first).map_err(|source| WindowError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(n == 1 && first[0] == b'{')
}

/// Reads `path`: its header, each report handed to `each` in order, and its end (None: the
/// window was cut short).
pub fn read(
    path: &Path,
    mut each: impl FnMut(serde_json::Value),
) -> Result<(Header, Option<End>), WindowError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| WindowError::Io {
        path: name.clone(),
        source,
    })?;
    let mut lines = BufReader::new(file).lines();
    let io = |source| WindowError::Io {
        path: name.clone(),
        source,
    };
    let first = lines
        .next()
        .transpose()
        .map_err(io)?
        .ok_or_else(|| WindowError::NotAWindow(name.clone()))?;
    let v: serde_json::Value =
        serde_json::from_str(&first).map_err(|_| WindowError::NotAWindow(name.clone()))?;
    let Some(h) = v.get("observer_window") else {
        return Err(WindowError::NotAWindow(name));
    };
    let found = h["format"].as_u64().unwrap_or(0) as u32;
    if found != FORMAT {
        return Err(WindowError::UnsupportedFormat {
            path: name,
            found,
            version: env!("CARGO_PKG_VERSION"),
        });
    }
    let header: Header = serde_json::from_value(h.clone()).map_err(|e| WindowError::Corrupt {
        path: name.clone(),
        line: 1,
        what: format!("its header does not read: {e}"),
    })?;
    let mut end = None;
    for (i, line) in lines.enumerate() {
        let line = line.map_err(io)?;
        let at = i as u64 + 2;
        if line.trim().is_empty() {
            continue;
        }
        if end.is_some() {
            return Err(WindowError::Corrupt {
                path: name,
                line: at,
                what: "a line after the window's end".into(),
            });
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| WindowError::Corrupt {
                path: name.clone(),
                line: at,
                what: format!("not JSON ({e})"),
            })?;
        if let Some(e) = v.get("observer_window_end") {
            end = Some(
                serde_json::from_value(e.clone()).map_err(|e| WindowError::Corrupt {
                    path: name.clone(),
                    line: at,
                    what: format!("its end does not read: {e}"),
                })?,
            );
        } else {
            each(v);
        }
    }
    Ok((header, end))
}

/// A window being written: the header at once, the reports as they come (through
/// [`Writer::reports`], from any thread), the end last.
pub struct Writer {
    path: String,
    out: Arc<Mutex<BufWriter<std::fs::File>>>,
}

/// The reports' side of a [`Writer`]: a `Write` that appends the agent's lines.
#[derive(Clone)]
pub struct Reports(Arc<Mutex<BufWriter<std::fs::File>>>);

impl Write for Reports {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).flush()
    }
}

impl Writer {
    pub fn create(path: &Path, header: &Header) -> Result<Self, WindowError> {
        let name = path.display().to_string();
        let write = |source| WindowError::Write {
            path: name.clone(),
            source,
        };
        let mut out = BufWriter::new(std::fs::File::create(path).map_err(write)?);
        let line = serde_json::json!({ "observer_window": header });
        writeln!(out, "{line}").map_err(write)?;
        out.flush().map_err(write)?;
        Ok(Self {
            path: name,
            out: Arc::new(Mutex::new(out)),
        })
    }

    pub fn reports(&self) -> Reports {
        Reports(self.out.clone())
    }

    /// Writes the end line and flushes.
    pub fn finish(self, end: &End) -> Result<(), WindowError> {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let line = serde_json::json!({ "observer_window_end": end });
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(|source| WindowError::Write {
                path: self.path.clone(),
                source,
            })
    }
}

/// The rules of `t` without what changes while nothing changes: iptables-save's packet
/// and byte counters and its dated comments, nft's counters. Two reads of an unchanged node
/// compare equal.
pub fn rules_only(t: &LiveTexts) -> [Option<String>; 4] {
    fn save(s: &Option<String>) -> Option<String> {
        s.as_ref().map(|s| {
            s.lines()
                .filter(|l| !l.starts_with('#'))
                .map(|l| {
                    // `[pkts:bytes] -A ...` (-c) and `:CHAIN POLICY [pkts:bytes]`.
                    let l = match l.strip_prefix('[').and_then(|r| r.split_once("] ")) {
                        Some((_, rest)) => rest,
                        None => l,
                    };
                    match l.rfind(" [") {
                        Some(i) if l.starts_with(':') => &l[..i],
                        _ => l,
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
    }
    fn strip(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                m.remove("packets");
                m.remove("bytes");
                m.remove("metainfo");
                m.values_mut().for_each(strip);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let nft = t.nft.as_ref().map(|s| match serde_json::from_str(s) {
        Ok(mut v) => {
            strip(&mut v);
            v.to_string()
        }
        Err(_) => s.clone(),
    });
    [save(&t.iptables), save(&t.ip6tables), nft, t.ipset.clone()]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            format: FORMAT,
            observer: "test".into(),
            source: "traces".into(),
            agent: "/tmp/agent.sock".into(),
            node: Some("worker-1".into()),
            filter: Some("udp".into()),
            opened: 1,
            ruleset: LiveTexts {
                iptables: Some("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n".into()),
                ..Default::default()
            },
            ruleset_failures: vec![],
        }
    }

    #[test]
    fn a_window_reads_back_as_written_and_a_cut_one_has_no_end() {
        use crate::commands::rulefiles::Temp;
        let t = Temp::new("window.ndjson", "");
        let p = std::path::PathBuf::from(t.path());
        let w = Writer::create(&p, &header()).unwrap();
        let mut r = w.reports();
        r.write_all(b"{\"schema\":3,\"n\":1}\n{\"schema\":3,\"n\":2}\n")
            .unwrap();
        w.finish(&End {
            reports: 2,
            stopped_by: "the agent".into(),
            ..Default::default()
        })
        .unwrap();
        assert!(is_window(&p).unwrap());
        let mut got = Vec::new();
        let (h, end) = read(&p, |v| got.push(v["n"].as_u64().unwrap())).unwrap();
        assert_eq!(got, [1, 2]);
        assert_eq!(h.node.as_deref(), Some("worker-1"));
        assert_eq!(h.ruleset, header().ruleset);
        assert_eq!(end.unwrap().reports, 2);

        let cut_t = Temp::new("window-cut.ndjson", "");
        let cut = std::path::PathBuf::from(cut_t.path());
        let text = std::fs::read_to_string(&p).unwrap();
        let without_end: Vec<&str> = text.lines().take(2).collect();
        std::fs::write(&cut, without_end.join("\n")).unwrap();
        let (_, end) = read(&cut, |_| {}).unwrap();
        assert!(end.is_none());

        let other_t = Temp::new("window-other.json", "");
        let other = std::path::PathBuf::from(other_t.path());
        std::fs::write(&other, "{\"schema\":3}\n").unwrap();
        let e = read(&other, |_| {}).unwrap_err().to_string();
        assert!(e.contains("not a capture window"), "{e}");
    }

    #[test]
    fn counters_and_dates_do_not_make_rules_differ() {
        let a = LiveTexts {
            iptables: Some(
                "# Generated by iptables-save on Mon\n*filter\n:INPUT ACCEPT [5:300]\n\
                 [3:180] -A INPUT -p udp -j DROP\nCOMMIT\n"
                    .into(),
            ),
            nft: Some(
                r#"{"nftables":[{"metainfo":{"version":"1"}},{"rule":{"expr":[{"counter":{"packets":3,"bytes":9}}]}}]}"#
                    .into(),
            ),
            ..Default::default()
        };
        let mut b = a.clone();
        b.iptables = Some(
            "# Generated by iptables-save on Tue\n*filter\n:INPUT ACCEPT [9:900]\n\
             [7:420] -A INPUT -p udp -j DROP\nCOMMIT\n"
                .into(),
        );
        b.nft = Some(
            r#"{"nftables":[{"metainfo":{"version":"2"}},{"rule":{"expr":[{"counter":{"packets":8,"bytes":1}}]}}]}"#
                .into(),
        );
        assert_eq!(rules_only(&a), rules_only(&b));
        let mut c = b.clone();
        c.iptables = Some(
            "*filter\n:INPUT ACCEPT [9:900]\n[7:420] -A INPUT -p tcp -j DROP\nCOMMIT\n".into(),
        );
        assert_ne!(rules_only(&a), rules_only(&c));
    }
}
