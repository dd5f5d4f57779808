//! `--record` files: the raw traversal records of a tail run with everything needed to turn
//! them into the same reports again without the kernel (docs/recording.md).
//!
//! The file is an 8-byte magic, a format version (u32 LE), then frames of
//! `kind (u8) | length (u32 LE) | payload | CRC-32 of the three (u32 LE)`: one header (JSON: versions, netns, the kernel
//! layout the decoder uses, the mark dictionary), then, in the order the collector met them,
//! context (JSON: probe plans by generation, re-plan windows, interface names and kernel
//! symbols as first used) and records (the lost-packet counter as of that record, u64 LE,
//! then the ring-buffer bytes exactly as the probes wrote them), and last an end marker
//! holding the number of frames before it. A damaged frame or a missing end is said, never
//! read as data; format 1 (no checksums, no end) is still read, with a warning.

use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use anyhow::{Context, Result};
use observer_rules::LiveNode;

use crate::kernel::btf::TupleLayout;
use crate::kernel::plan::{HookPlan, Table};
use crate::kernel::session::{Consumer, Next, Replan, Stop};
use crate::pipeline::Learned;
use observer_common::traversal::{MAX_STEPS, MAX_VISITS, RECORD_HEAD_BYTES, STEP_BYTES};
use observer_model::marks::MarkDictionary;
use observer_model::{Family as NfFamily, Hook as NfHook};

pub const MAGIC: [u8; 8] = *b"OBSVREC\n";
/// The format this observer writes.
pub const FORMAT: u32 = 2;
/// The older format it still reads: the same frames without checksums and end marker.
pub const FORMAT_V1: u32 = 1;

const HEADER: u8 = 1;
const META: u8 = 2;
const RECORD: u8 = 3;
/// The last frame: u64 LE, the number of frames between the header and it.
const END: u8 = 4;
/// A frame longer than this is corruption, not data (records are a few hundred bytes;
/// the largest context frame is a plan set).
const MAX_FRAME: u32 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("cannot read the recording {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write the recording {path}: {source}; check the path and free space")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{0} is not an observer recording (it does not start with the recording magic); \
         make one with `observer tail --record FILE`"
    )]
    NotARecording(String),
    #[error(
        "{path} is a recording of format {found}; this observer ({version}) reads formats \
         {FORMAT_V1} and {FORMAT}: replay it with the observer version that recorded it"
    )]
    UnsupportedFormat {
        path: String,
        found: u32,
        version: &'static str,
    },
    #[error(
        "{path} was recorded with another traversal record layout ({found}; this observer \
         has {ours}): replay it with the observer version that recorded it ({recorded_by})"
    )]
    WireMismatch {
        path: String,
        found: String,
        ours: String,
        recorded_by: String,
    },
    #[error("{path}: frame at byte {offset}: {what}; the file is damaged")]
    Corrupt {
        path: String,
        offset: u64,
        what: String,
    },
}

/// The layout of the probes' traversal record, as this build has it: a recording made
/// with another one cannot be decoded by this build.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wire {
    pub record_head_bytes: usize,
    pub step_bytes: usize,
    pub max_steps: usize,
    pub max_visits: usize,
    /// Where the fields the collector reads sit (`field@offset`): a layout that moved them
    /// without changing the sizes above is another layout too.
    pub fields: String,
}

impl Wire {
    pub fn current() -> Self {
        use observer_common::traversal::{Step, TraversalRecord as R, Visit};
        use std::mem::offset_of;
        let fields = [
            ("end", offset_of!(R, end)),
            ("nvisits", offset_of!(R, nvisits)),
            ("nsteps", offset_of!(R, nsteps)),
            ("reason", offset_of!(R, reason)),
            ("generation", offset_of!(R, generation)),
            ("skb", offset_of!(R, skb)),
            ("ts_first", offset_of!(R, ts_first)),
            ("location", offset_of!(R, location)),
            ("ct_orig", offset_of!(R, ct_orig)),
            ("visits", offset_of!(R, visits)),
            ("visit.ifindex_in", offset_of!(Visit, ifindex_in)),
            ("steps", offset_of!(R, steps)),
            ("step.mark", offset_of!(Step, mark)),
            ("step.saddr", offset_of!(Step, saddr)),
        ]
        .iter()
        .map(|(f, o)| format!("{f}@{o}"))
        .collect::<Vec<_>>()
        .join(" ");
        Self {
            record_head_bytes: RECORD_HEAD_BYTES,
            step_bytes: STEP_BYTES,
            max_steps: MAX_STEPS,
            max_visits: MAX_VISITS,
            fields,
        }
    }
}

impl std::fmt::Display for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "head {} bytes, steps of {} bytes, {} steps, {} visits, fields {}",
            self.record_head_bytes, self.step_bytes, self.max_steps, self.max_visits, self.fields
        )
    }
}

/// The first frame.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Always [`FORMAT`] (also in the file's first bytes).
    pub format: u32,
    /// `observer --version` of the recorder.
    pub observer_version: String,
    /// The recording host's kernel release (for the reader; nothing depends on it).
    pub kernel: String,
    /// Seconds since the Unix epoch when recording started.
    pub started: u64,
    /// The observed namespace as reports name it (`--netns`, or `current`).
    pub netns: String,
    pub wire: Wire,
    /// `struct nf_conntrack_tuple` offsets, as resolved from the recording host's BTF.
    pub tuple: TupleLayout,
    /// `enum skb_drop_reason` value -> name, from the recording host's BTF.
    pub drop_reasons: HashMap<u32, String>,
    /// The mark dictionary in force: bit -> name.
    pub marks: Vec<(u32, String)>,
}

impl Header {
    pub fn new(
        netns: &str,
        tuple: &TupleLayout,
        drop_reasons: &HashMap<u32, String>,
        marks: &MarkDictionary,
    ) -> Self {
        Self {
            format: FORMAT,
            observer_version: env!("CARGO_PKG_VERSION").into(),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            netns: netns.into(),
            wire: Wire::current(),
            tuple: *tuple,
            drop_reasons: drop_reasons.clone(),
            marks: marks.entries(),
        }
    }
}

/// One (family, hook)'s probe plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanDto {
    /// `ipv4` or `ipv6`.
    pub family: String,
    /// `NF_INET_*` number.
    pub hook: u8,
    /// (name, priority) in priority order.
    pub tables: Vec<(String, i32)>,
    pub points: Vec<i32>,
    pub programs: Vec<usize>,
}

impl From<&HookPlan> for PlanDto {
    fn from(p: &HookPlan) -> Self {
        Self {
            family: p.family.name().into(),
            hook: p.hook as u8,
            tables: p
                .tables
                .iter()
                .map(|t| (t.name.to_string(), t.priority))
                .collect(),
            points: p.points.clone(),
            programs: p.programs.clone(),
        }
    }
}

impl PlanDto {
    pub fn to_plan(&self) -> Option<HookPlan> {
        Some(HookPlan {
            family: NfFamily::ALL
                .into_iter()
                .find(|f| f.name() == self.family)?,
            hook: NfHook::from_raw(self.hook)?,
            tables: self
                .tables
                .iter()
                .map(|(name, priority)| Table {
                    name: name.as_str().into(),
                    priority: *priority,
                })
                .collect(),
            points: self.points.clone(),
            programs: self.programs.clone(),
        })
    }
}

/// Context met along the way, in the order the collector met it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "meta", rename_all = "snake_case")]
pub enum Meta {
    /// The probe plan of a generation, which is now the current one.
    Plans { generation: u8, plans: Vec<PlanDto> },
    /// The ruleset changed at `from` and the probes were re-planned at `to`
    /// (`CLOCK_MONOTONIC` ns, the records' clock).
    Replan { from: u64, to: u64 },
    /// Interface names and kernel symbols as the following records' reports used them.
    Names {
        ifnames: Vec<(u32, String)>,
        symbols: Vec<(u64, String)>,
    },
    /// The node's ruleset as the tail read it (at start, and after each change), and the
    /// mark names it gave: replay names rules from it as the tail did. `generation` is the
    /// rule namer's (it keys its cache).
    Ruleset {
        generation: u64,
        /// Boxed: the node's texts are far larger than the other variants.
        texts: Box<observer_rules::LiveTexts>,
        marks: Vec<(u32, String)>,
    },
}

impl Meta {
    pub fn plans(generation: u8, plans: &[HookPlan]) -> Self {
        Self::Plans {
            generation,
            plans: plans.iter().map(PlanDto::from).collect(),
        }
    }
}

/// Writes a recording as records come. A write that fails stops the recording (said once)
/// and every record after it is counted as not recorded.
pub struct Recorder {
    path: PathBuf,
    out: super::StoppingFile,
    ifnames: HashMap<u32, String>,
    symbols: HashMap<u64, String>,
    /// Frames written after the header (the end marker says how many).
    frames: u64,
    /// Records written.
    pub records: u64,
    /// Records that could not be written.
    pub failed: u64,
}

impl Recorder {
    /// Creates `path` and writes the magic, version and header.
    pub fn create(path: &Path, header: &Header) -> Result<Self, RecordingError> {
        let file = std::fs::File::create(path).map_err(|source| RecordingError::Write {
            path: path.display().to_string(),
            source,
        })?;
        Self::to_writer(path, Box::new(file), header)
    }

    /// Writes a recording to any writer (`path` names it in messages).
    pub fn to_writer(
        path: &Path,
        w: Box<dyn Write + Send>,
        header: &Header,
    ) -> Result<Self, RecordingError> {
        let mut r = Self {
            path: path.into(),
            out: Some(BufWriter::new(w)),
            ifnames: HashMap::new(),
            symbols: HashMap::new(),
            frames: 0,
            records: 0,
            failed: 0,
        };
        let io = |source| RecordingError::Write {
            path: path.display().to_string(),
            source,
        };
        let out = r.out.as_mut().expect("just made");
        out.write_all(&MAGIC).map_err(io)?;
        out.write_all(&FORMAT.to_le_bytes()).map_err(io)?;
        let json = serde_json::to_vec(header).expect("a header serializes");
        frame(out, HEADER, &[&json]).map_err(io)?;
        Ok(r)
    }

    fn write(&mut self, kind: u8, parts: &[&[u8]]) -> bool {
        let Some(out) = &mut self.out else {
            return false;
        };
        if let Err(e) = frame(out, kind, parts) {
            log::warn!(
                "writing the recording {} failed ({e}); recording stops here, the records \
                 not written are counted in the summary",
                self.path.display()
            );
            self.out = None;
            return false;
        }
        self.frames += 1;
        true
    }

    pub fn meta(&mut self, m: &Meta) {
        let json = serde_json::to_vec(m).expect("context serializes");
        self.write(META, &[&json]);
    }

    /// Notes the names a report used; those the file does not hold yet (or holds with
    /// another value: a rename) are written before the record that needs them.
    pub fn names(&mut self, learned: Learned) {
        let ifnames: Vec<(u32, String)> = learned
            .ifnames
            .into_iter()
            .filter(|(i, n)| self.ifnames.get(i) != Some(n))
            .collect();
        let symbols: Vec<(u64, String)> = learned
            .symbols
            .into_iter()
            .filter(|(a, s)| self.symbols.get(a) != Some(s))
            .collect();
        if ifnames.is_empty() && symbols.is_empty() {
            return;
        }
        self.ifnames.extend(ifnames.iter().cloned());
        self.symbols.extend(symbols.iter().cloned());
        self.meta(&Meta::Names { ifnames, symbols });
    }

    /// One ring-buffer record, with the kernel's lost-packet count as of it.
    pub fn record(&mut self, raw: &[u8], lost_now: u64) {
        if self.write(RECORD, &[&lost_now.to_le_bytes(), raw]) {
            self.records += 1;
        } else {
            self.failed += 1;
        }
    }

    /// Hands what is buffered to the file, so that a tail killed outright leaves a
    /// recording of everything up to about now (a write that fails stops it, as above).
    pub fn flush(&mut self) {
        super::flush_or_stop(&mut self.out, "the recording", &self.path);
    }

    /// Writes the end marker and flushes the file; false if the last buffered records were
    /// not written. A recording that stopped on a failed write gets no end marker: its
    /// reader says it is incomplete.
    pub fn finish(&mut self) -> bool {
        if let Some(out) = self.out.as_mut()
            && let Err(e) = frame(out, END, &[&self.frames.to_le_bytes()])
        {
            log::warn!("writing the recording {}: {e}", self.path.display());
            self.out = None;
            return false;
        }
        super::finish_file(&mut self.out, "the recording", &self.path)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The recording as a sink of the pipeline: each record after the names its report used,
/// and the context as it changes. Write failures are counted (`failed`), not returned: a
/// recording that stops does not stop the tail.
impl crate::pipeline::Sink for Recorder {
    fn handled(&mut self, h: &crate::pipeline::Handled<'_>) -> std::io::Result<()> {
        if let Some(learned) = h.learned {
            self.names(learned.clone());
        }
        self.record(h.raw, h.lost_now);
        Ok(())
    }
    fn plans(&mut self, generation: u8, plans: &[HookPlan]) {
        self.meta(&Meta::plans(generation, plans));
    }
    fn replanned(&mut self, from: u64, to: u64) {
        self.meta(&Meta::Replan { from, to });
    }
    fn ruleset(
        &mut self,
        generation: u64,
        texts: &observer_rules::LiveTexts,
        marks: &[(u32, String)],
    ) {
        self.meta(&Meta::Ruleset {
            generation,
            texts: Box::new(texts.clone()),
            marks: marks.to_vec(),
        });
    }
}

fn frame(out: &mut impl Write, kind: u8, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let head = frame_head(kind, len as u32);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head);
    out.write_all(&head)?;
    for p in parts {
        crc.update(p);
        out.write_all(p)?;
    }
    out.write_all(&crc.finalize().to_le_bytes())
}

fn frame_head(kind: u8, len: u32) -> [u8; 5] {
    let mut head = [kind, 0, 0, 0, 0];
    head[1..].copy_from_slice(&len.to_le_bytes());
    head
}

/// What follows the header.
#[derive(Debug, PartialEq)]
pub enum Frame {
    Meta(Meta),
    /// Context of a kind this reader does not know (written by a later observer of the same
    /// format): skipped, with its name.
    UnknownMeta(String),
    Record {
        lost_now: u64,
        bytes: Vec<u8>,
    },
}

/// Reads a recording frame by frame.
pub struct Reader<R> {
    path: String,
    input: R,
    offset: u64,
    /// The file's format: [`FORMAT`], or [`FORMAT_V1`] (no checksums, no end marker).
    pub format: u32,
    /// Frames read after the header.
    frames: u64,
    /// The end marker was read (format 2): nothing may follow it.
    ended: bool,
    pub header: Header,
}

impl Reader<std::io::BufReader<std::fs::File>> {
    pub fn open(path: &Path) -> Result<Self, RecordingError> {
        let file = std::fs::File::open(path).map_err(|source| RecordingError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::new(&path.display().to_string(), std::io::BufReader::new(file))
    }
}

impl<R: Read> Reader<R> {
    /// Checks the magic, the format version and the record layout, and reads and checks the
    /// header: every field a report reads is validated here, before any record uses it.
    pub fn new(path: &str, mut input: R) -> Result<Self, RecordingError> {
        let mut start = [0u8; 12];
        if read_full(&mut input, &mut start).map_err(|source| RecordingError::Io {
            path: path.into(),
            source,
        })? < 12
            || start[..8] != MAGIC
        {
            return Err(RecordingError::NotARecording(path.into()));
        }
        let found = u32::from_le_bytes(start[8..12].try_into().expect("4 bytes"));
        if found != FORMAT && found != FORMAT_V1 {
            return Err(RecordingError::UnsupportedFormat {
                path: path.into(),
                found,
                version: env!("CARGO_PKG_VERSION"),
            });
        }
        let mut r = Self {
            path: path.into(),
            input,
            offset: 12,
            format: found,
            frames: 0,
            ended: false,
            header: Header {
                format: found,
                observer_version: String::new(),
                kernel: String::new(),
                started: 0,
                netns: String::new(),
                wire: Wire::current(),
                tuple: TupleLayout {
                    src_addr: 0,
                    src_port: 0,
                    dst_addr: 0,
                    dst_port: 0,
                    protonum: 0,
                    size: 0,
                },
                drop_reasons: HashMap::new(),
                marks: Vec::new(),
            },
        };
        let at = r.offset;
        let (kind, payload) = r
            .next_raw()?
            .ok_or_else(|| r.corrupt(at, "the header is missing".into()))?;
        if kind != HEADER {
            return Err(r.corrupt(at, format!("expected the header, found frame kind {kind}")));
        }
        r.frames = 0;
        r.header = serde_json::from_slice(&payload)
            .map_err(|e| r.corrupt(at, format!("unreadable header: {}", short(&e))))?;
        if r.header.wire != Wire::current() {
            return Err(RecordingError::WireMismatch {
                path: r.path.clone(),
                found: short(&r.header.wire),
                ours: Wire::current().to_string(),
                recorded_by: short(&r.header.observer_version),
            });
        }
        if let Err(what) = r.header.check(found) {
            return Err(r.corrupt(at, format!("invalid header: {what}")));
        }
        Ok(r)
    }

    /// Whether the file is complete: format 2 and its end marker was read. Meaningful once
    /// [`Self::next_frame`] returned `None`.
    pub fn complete(&self) -> bool {
        self.ended
    }

    fn corrupt(&self, offset: u64, what: String) -> RecordingError {
        RecordingError::Corrupt {
            path: self.path.clone(),
            offset,
            what,
        }
    }

    /// The next frame's kind and payload, its checksum verified; `None` at the end of the
    /// file (format 1) or at the end marker (format 2).
    fn next_raw(&mut self) -> Result<Option<(u8, Vec<u8>)>, RecordingError> {
        if self.ended {
            return Ok(None);
        }
        let at = self.offset;
        let io = |source| RecordingError::Io {
            path: self.path.clone(),
            source,
        };
        let mut head = [0u8; 5];
        match read_full(&mut self.input, &mut head).map_err(io)? {
            0 => return Ok(None),
            5 => {}
            n => {
                return Err(self.corrupt(
                    at,
                    format!("cut short after {n} bytes (the recorder was interrupted?)"),
                ));
            }
        }
        let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes"));
        if len > MAX_FRAME {
            return Err(self.corrupt(at, format!("implausible length {len}")));
        }
        // Grown as bytes arrive, so that a damaged length costs no more than the file has.
        let mut payload = Vec::new();
        let got = (&mut self.input)
            .take(u64::from(len))
            .read_to_end(&mut payload)
            .map_err(|source| RecordingError::Io {
                path: self.path.clone(),
                source,
            })?;
        if got < len as usize {
            return Err(self.corrupt(
                at,
                format!("cut short: {got} of {len} bytes (the recorder was interrupted?)"),
            ));
        }
        let mut trailer = 0;
        if self.format != FORMAT_V1 {
            let mut crc = [0u8; 4];
            let n = read_full(&mut self.input, &mut crc).map_err(|source| RecordingError::Io {
                path: self.path.clone(),
                source,
            })?;
            if n < 4 {
                return Err(self.corrupt(
                    at,
                    "cut short in its checksum (the recorder was interrupted?)".into(),
                ));
            }
            let mut h = crc32fast::Hasher::new();
            h.update(&head);
            h.update(&payload);
            if h.finalize() != u32::from_le_bytes(crc) {
                return Err(self.corrupt(
                    at,
                    format!(
                        "checksum mismatch (frame kind {}, {len} bytes): its bytes were \
                         changed after it was written",
                        head[0]
                    ),
                ));
            }
            trailer = 4;
        }
        self.offset += 5 + u64::from(len) + trailer;
        if head[0] == END && self.format != FORMAT_V1 {
            let count = <[u8; 8]>::try_from(&payload[..])
                .ok()
                .map(u64::from_le_bytes);
            if count != Some(self.frames) {
                return Err(self.corrupt(
                    at,
                    format!(
                        "the end marker counts {} frames, {} were read: frames are missing \
                         or were added",
                        count.map_or_else(|| "?".to_string(), |c| c.to_string()),
                        self.frames
                    ),
                ));
            }
            self.ended = true;
            let mut rest = [0u8; 1];
            if read_full(&mut self.input, &mut rest).map_err(|source| RecordingError::Io {
                path: self.path.clone(),
                source,
            })? > 0
            {
                return Err(self.corrupt(
                    self.offset,
                    "bytes after the end marker (two recordings joined?)".into(),
                ));
            }
            return Ok(None);
        }
        self.frames += 1;
        Ok(Some((head[0], payload)))
    }

    /// The next frame; `None` at the end ([`Self::complete`] then says whether the file
    /// ended with its end marker).
    pub fn next_frame(&mut self) -> Result<Option<Frame>, RecordingError> {
        let at = self.offset;
        let Some((kind, payload)) = self.next_raw()? else {
            return Ok(None);
        };
        Ok(Some(match kind {
            META => {
                let v: serde_json::Value = serde_json::from_slice(&payload)
                    .map_err(|e| self.corrupt(at, format!("unreadable context: {}", short(&e))))?;
                let name = v.get("meta").and_then(|m| m.as_str()).map(str::to_string);
                let name = name.as_deref();
                match name {
                    Some(name) if !KNOWN_META.contains(&name) => Frame::UnknownMeta(short(&name)),
                    _ => {
                        let m = serde_json::from_value::<Meta>(v).map_err(|e| {
                            self.corrupt(
                                at,
                                format!(
                                    "unreadable context `{}`: {}",
                                    short(&name.unwrap_or("?")),
                                    short(&e)
                                ),
                            )
                        })?;
                        m.check()
                            .map_err(|what| self.corrupt(at, format!("invalid context: {what}")))?;
                        Frame::Meta(m)
                    }
                }
            }
            RECORD => {
                if payload.len() < 8 {
                    return Err(self.corrupt(at, "record frame without its counter".into()));
                }
                Frame::Record {
                    lost_now: u64::from_le_bytes(payload[..8].try_into().expect("8 bytes")),
                    bytes: payload[8..].to_vec(),
                }
            }
            k => return Err(self.corrupt(at, format!("unknown frame kind {k}"))),
        }))
    }
}

/// Every kind of context this reader knows: one of these that does not parse is damage,
/// not the work of a later observer.
const KNOWN_META: [&str; 4] = ["plans", "replan", "names", "ruleset"];

/// Text from the file for a message: at most 200 characters, control characters escaped.
pub fn short(x: &dyn std::fmt::Display) -> String {
    super::for_terminal(&x.to_string(), 200)
}

impl Header {
    /// What a report would trip over: tuple offsets outside the kernel's tuple, a format
    /// other than the file's.
    fn check(&self, format: u32) -> Result<(), String> {
        use observer_common::CT_TUPLE_BYTES;
        if self.format != format {
            return Err(format!(
                "it says format {}, the file format {format}",
                self.format
            ));
        }
        let t = &self.tuple;
        for (field, at, width) in [
            ("src_addr", t.src_addr, 16),
            ("dst_addr", t.dst_addr, 16),
            ("src_port", t.src_port, 2),
            ("dst_port", t.dst_port, 2),
            ("protonum", t.protonum, 1),
        ] {
            if at.checked_add(width).is_none_or(|e| e > CT_TUPLE_BYTES) {
                return Err(format!(
                    "conntrack tuple field {field} at byte {at} lies outside the \
                     {CT_TUPLE_BYTES} bytes the probes copy"
                ));
            }
        }
        Ok(())
    }
}

impl Meta {
    /// What a report would trip over in context that parsed.
    fn check(&self) -> Result<(), String> {
        match self {
            Meta::Plans { plans, .. } => {
                for p in plans {
                    let Some(plan) = p.to_plan() else {
                        return Err(format!(
                            "a probe plan names an unknown family or hook ({}, {})",
                            short(&p.family),
                            p.hook
                        ));
                    };
                    if plan.points.is_empty()
                        || plan.points.len() != plan.programs.len()
                        || plan.points.windows(2).any(|w| w[0] >= w[1])
                        || plan.programs.iter().any(|&p| p >= 64)
                    {
                        return Err(format!(
                            "the probe plan of {} hook {} has {} points and {} programs (one \
                             program per point, points ascending, programs 0 to 63)",
                            p.family,
                            p.hook,
                            plan.points.len(),
                            plan.programs.len(),
                        ));
                    }
                }
                Ok(())
            }
            Meta::Replan { .. } | Meta::Names { .. } | Meta::Ruleset { .. } => Ok(()),
        }
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A recorded session: the records and context changes of a `tail --record` recording
/// handed to `c` through the same [`Consumer`] calls a live session makes, in the order the tail met them (the
/// names of context frames a later observer wrote, which this one does not know, are
/// returned with the reason it stopped). `file` names the recording in messages.
pub fn replay<R: std::io::Read, C: Consumer>(
    reader: &mut Reader<R>,
    file: &std::path::Path,
    c: &mut C,
) -> Result<(&'static str, Vec<String>)> {
    let mut unknown = Vec::new();
    let why = loop {
        let Some(frame) = reader.next_frame()? else {
            break "end of recording";
        };
        match frame {
            Frame::Record { lost_now, bytes } => {
                if let Next::Stop(why) = c.on_record(&bytes, lost_now) {
                    break why;
                }
            }
            Frame::Meta(Meta::Plans { generation, plans }) => {
                let plans = plans
                    .iter()
                    .map(|p| {
                        p.to_plan().with_context(|| {
                            format!(
                                "{}: a probe plan names an unknown family or hook ({}, {}); \
                                 the file is damaged or from another observer",
                                file.display(),
                                p.family,
                                p.hook
                            )
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                c.on_replan(Replan::Plans {
                    probes: None,
                    generation,
                    plans: &plans,
                });
            }
            Frame::Meta(Meta::Replan { from, to }) => c.on_replan(Replan::Replanned { from, to }),
            Frame::Meta(Meta::Ruleset {
                generation,
                texts,
                marks,
            }) => {
                let live = LiveNode::parse(*texts);
                c.on_replan(Replan::Ruleset {
                    probes: None,
                    live: &live,
                    light: false,
                    recorded: Some((generation, &marks)),
                });
            }
            Frame::Meta(Meta::Names { ifnames, symbols }) => c.on_replan(Replan::Names {
                ifnames: &ifnames,
                symbols: &symbols,
            }),
            Frame::UnknownMeta(name) => {
                log::warn!(
                    "skipping context `{name}`, which this observer does not know (recorded \
                     by observer {})",
                    reader.header.observer_version
                );
                unknown.push(name);
            }
        }
    };
    c.on_stop(Stop {
        probes: None,
        why,
        undrained: 0,
    });
    Ok((why, unknown))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::plan::full_plan;

    fn header() -> Header {
        let tuple = TupleLayout {
            src_addr: 0,
            src_port: 16,
            dst_addr: 20,
            dst_port: 36,
            protonum: 38,
            size: 40,
        };
        Header::new(
            "lab-node",
            &tuple,
            &HashMap::from([(2, "NOT_SPECIFIED".to_string())]),
            &MarkDictionary::default(),
        )
    }

    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn written(f: impl FnOnce(&mut Recorder)) -> Vec<u8> {
        let buf = Shared::default();
        let mut r = Recorder::to_writer(Path::new("mem"), Box::new(buf.clone()), &header())
            .expect("header written");
        f(&mut r);
        assert!(r.finish());
        buf.0.lock().unwrap().clone()
    }

    #[test]
    fn frames_round_trip_in_order() {
        let plans = full_plan(None);
        let bytes = written(|r| {
            r.meta(&Meta::plans(3, &plans));
            r.names(Learned {
                ifnames: vec![(2, "eth0".into())],
                symbols: vec![(0xffff_0010, "nf_hook_slow+0x10".into())],
            });
            r.record(&[3, 1, 2], 7);
            // Already known: no new frame.
            r.names(Learned {
                ifnames: vec![(2, "eth0".into())],
                symbols: vec![],
            });
            r.meta(&Meta::Replan { from: 10, to: 20 });
            r.record(&[3, 4], 9);
        });
        let mut rd = Reader::new("mem", &bytes[..]).expect("readable");
        assert_eq!(rd.header, header());
        let mut frames = Vec::new();
        while let Some(f) = rd.next_frame().expect("frame") {
            frames.push(f);
        }
        assert_eq!(frames.len(), 5, "{frames:?}");
        let Frame::Meta(Meta::Plans {
            generation,
            plans: p,
        }) = &frames[0]
        else {
            panic!("plans first: {frames:?}");
        };
        assert_eq!(*generation, 3);
        let back: Vec<HookPlan> = p.iter().map(|d| d.to_plan().unwrap()).collect();
        assert_eq!(back, plans);
        assert!(
            matches!(&frames[1], Frame::Meta(Meta::Names { ifnames, .. }) if ifnames[0].1 == "eth0")
        );
        assert_eq!(
            frames[2],
            Frame::Record {
                lost_now: 7,
                bytes: vec![3, 1, 2]
            }
        );
        assert_eq!(frames[3], Frame::Meta(Meta::Replan { from: 10, to: 20 }));
        assert!(matches!(frames[4], Frame::Record { lost_now: 9, .. }));
    }

    #[test]
    fn a_rename_is_written_again() {
        let bytes = written(|r| {
            r.names(Learned {
                ifnames: vec![(2, "eth0".into())],
                symbols: vec![],
            });
            r.names(Learned {
                ifnames: vec![(2, "wan0".into())],
                symbols: vec![],
            });
        });
        let mut rd = Reader::new("mem", &bytes[..]).unwrap();
        let mut names = Vec::new();
        while let Some(Frame::Meta(Meta::Names { ifnames, .. })) = rd.next_frame().unwrap() {
            names.extend(ifnames);
        }
        assert_eq!(names, vec![(2, "eth0".into()), (2, "wan0".into())]);
    }

    #[test]
    fn rejects_what_it_cannot_read_with_what_to_do() {
        let good = written(|r| r.record(&[3], 0));
        let err = Reader::new("x", &b"not a recording at all"[..])
            .err()
            .unwrap();
        assert!(matches!(err, RecordingError::NotARecording(_)));
        assert!(err.to_string().contains("observer tail --record"));

        let mut future = good.clone();
        future[8..12].copy_from_slice(&7u32.to_le_bytes());
        let err = Reader::new("x", &future[..]).err().unwrap();
        assert!(
            matches!(err, RecordingError::UnsupportedFormat { found: 7, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("format 7"), "{err}");
        assert!(err.to_string().contains("reads formats 1 and 2"), "{err}");

        // Another record layout: refused before any record is decoded wrongly.
        let mut h = header();
        h.wire.step_bytes += 8;
        let mut moved = header();
        moved.wire.fields = moved.wire.fields.replace("skb@", "skb@8+");
        let buf = Shared::default();
        let mut r = Recorder::to_writer(Path::new("mem"), Box::new(buf.clone()), &moved).unwrap();
        r.finish();
        let bytes = buf.0.lock().unwrap().clone();
        let err = Reader::new("x", &bytes[..]).err().unwrap();
        assert!(matches!(err, RecordingError::WireMismatch { .. }), "{err}");
        let buf = Shared::default();
        let mut r = Recorder::to_writer(Path::new("mem"), Box::new(buf.clone()), &h).unwrap();
        r.finish();
        let other = buf.0.lock().unwrap().clone();
        let err = Reader::new("x", &other[..]).err().unwrap();
        assert!(matches!(err, RecordingError::WireMismatch { .. }), "{err}");

        // Cut short in the last frame: said, with where.
        let cut = &good[..good.len() - 1];
        let mut rd = Reader::new("x", cut).unwrap();
        assert!(matches!(rd.next_frame(), Ok(Some(Frame::Record { .. }))));
        let err = rd.next_frame().err().unwrap();
        assert!(err.to_string().contains("cut short"), "{err}");
    }

    #[test]
    fn context_of_a_later_kind_is_skipped_by_name() {
        let bytes = written(|r| {
            let json = br#"{"meta":"flows","text":"*filter"}"#;
            r.write(META, &[json]);
            r.record(&[3], 0);
        });
        let mut rd = Reader::new("x", &bytes[..]).unwrap();
        assert_eq!(
            rd.next_frame().unwrap(),
            Some(Frame::UnknownMeta("flows".into()))
        );
        assert!(matches!(
            rd.next_frame().unwrap(),
            Some(Frame::Record { .. })
        ));
        assert_eq!(rd.next_frame().unwrap(), None);
        assert!(rd.complete());
    }

    #[test]
    fn a_damaged_context_of_a_known_kind_is_damage_not_a_later_kind() {
        let bytes = written(|r| {
            // A ruleset whose texts lost their shape: not "from a later observer".
            r.write(META, &[br#"{"meta":"ruleset","generation":"x"}"#]);
        });
        let mut rd = Reader::new("x", &bytes[..]).unwrap();
        let err = rd.next_frame().unwrap_err().to_string();
        assert!(err.contains("unreadable context `ruleset`"), "{err}");
        assert!(err.contains("the file is damaged"), "{err}");
    }

    /// The bytes of a format-1 file: the same frames without checksums or end marker.
    fn format_1(h: &Header, frames: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend_from_slice(&FORMAT_V1.to_le_bytes());
        let mut h = h.clone();
        h.format = FORMAT_V1;
        let json = serde_json::to_vec(&h).unwrap();
        for (kind, payload) in std::iter::once((HEADER, json)).chain(frames.iter().cloned()) {
            b.extend_from_slice(&frame_head(kind, payload.len() as u32));
            b.extend_from_slice(&payload);
        }
        b
    }

    #[test]
    fn format_1_is_still_read() {
        let mut rec = 7u64.to_le_bytes().to_vec();
        rec.extend_from_slice(&[3, 1]);
        let bytes = format_1(&header(), &[(RECORD, rec)]);
        let mut rd = Reader::new("x", &bytes[..]).unwrap();
        assert_eq!(rd.format, FORMAT_V1);
        assert_eq!(
            rd.next_frame().unwrap(),
            Some(Frame::Record {
                lost_now: 7,
                bytes: vec![3, 1]
            })
        );
        assert_eq!(rd.next_frame().unwrap(), None);
        assert!(!rd.complete(), "format 1 has no end marker");
    }

    #[test]
    fn checksums_and_the_end_marker_catch_damage_and_cuts() {
        let good = written(|r| {
            r.record(&[3, 1, 2], 0);
            r.record(&[3, 4], 1);
        });
        let frames = |bytes: &[u8]| -> Result<(usize, bool), RecordingError> {
            let mut rd = Reader::new("x", bytes)?;
            let mut n = 0;
            while rd.next_frame()?.is_some() {
                n += 1;
            }
            Ok((n, rd.complete()))
        };
        assert_eq!(frames(&good).unwrap(), (2, true));
        // Every single-bit flip anywhere is an error (never the same frames read back).
        for bit in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(frames(&bad).is_err(), "flip of bit {bit} went unnoticed");
        }
        // Cut at a frame boundary (the end marker lost): read, but not complete.
        let end_frame = 5 + 8 + 4;
        let cut = &good[..good.len() - end_frame];
        assert_eq!(frames(cut).unwrap(), (2, false));
        // A whole record frame removed: the end marker's count says so.
        let second = 5 + 8 + 2 + 4;
        let mut removed = good[..good.len() - end_frame - second].to_vec();
        removed.extend_from_slice(&good[good.len() - end_frame..]);
        let err = frames(&removed).unwrap_err().to_string();
        assert!(err.contains("counts 2 frames, 1 were read"), "{err}");
        // Two recordings joined.
        let mut joined = good.clone();
        joined.extend_from_slice(&good);
        let err = frames(&joined).unwrap_err().to_string();
        assert!(err.contains("after the end marker"), "{err}");
    }

    #[test]
    fn header_fields_are_checked_before_use() {
        type Damage = fn(&mut Header);
        let cases: [(Damage, &str); 4] = [
            (|h| h.tuple.src_addr = 40, "src_addr at byte 40"),
            (|h| h.tuple.dst_port = usize::MAX, "dst_port at byte"),
            (|h| h.tuple.protonum = 48, "protonum at byte 48"),
            (|h| h.format = 1, "it says format 1, the file format 2"),
        ];
        for (damage, says) in cases {
            let mut h = header();
            damage(&mut h);
            let buf = Shared::default();
            let mut r = Recorder::to_writer(Path::new("mem"), Box::new(buf.clone()), &h).unwrap();
            r.finish();
            let bytes = buf.0.lock().unwrap().clone();
            let err = Reader::new("x", &bytes[..]).err().unwrap().to_string();
            assert!(
                err.contains("invalid header") && err.contains(says),
                "{err}"
            );
        }
        let bad_plan = written(|r| {
            let mut plans = full_plan(None);
            plans[0].programs.pop();
            r.meta(&Meta::plans(1, &plans));
        });
        let mut rd = Reader::new("x", &bad_plan[..]).unwrap();
        let err = rd.next_frame().unwrap_err().to_string();
        assert!(err.contains("invalid context: the probe plan"), "{err}");
    }

    #[test]
    fn text_from_the_file_is_shortened_and_escaped() {
        assert_eq!(short(&"a\x1b[2Jb\n"), "a\\u{1b}[2Jb\\n");
        let long = "x".repeat(1000);
        assert_eq!(short(&long).len(), 203);
    }
}
