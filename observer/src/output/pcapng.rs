//! `tail --pcapng FILE`: each printed traversal's packet (its first bytes from the network
//! header, taken where the traversal started) as a pcap-ng Enhanced Packet Block, on an
//! interface block per interface (LINKTYPE_RAW: the bytes start at the IP header), with the
//! traversal's one-line report as the packet's comment.
//!
//! The probes write packet bytes to their own ring buffer when a traversal starts; the
//! traversal's record comes later, when it ends. [`PacketStore`] holds the bytes until then,
//! by the identity both carry (skb address and start time), bounded. A traversal whose bytes
//! are missing (the probes' ring buffer was full, or they were held too long) is still
//! written, with no bytes and a comment saying so, and counted: never left out silently.
//!
//! The writer is a small subset of pcap-ng (section header, interface description, enhanced
//! packet blocks, with comments): <https://www.ietf.org/archive/id/draft-ietf-opsawg-pcapng-02.html>.

use std::collections::{HashMap, VecDeque};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use observer_common::kind;
use observer_common::packet_bytes::{PACKET_BYTES, PacketBytes};

/// LINKTYPE_RAW: the packet starts with an IPv4 or IPv6 header.
pub const LINKTYPE_RAW: u16 = 101;

#[derive(Debug, thiserror::Error)]
pub enum PcapngError {
    #[error("cannot write the pcap-ng file {path}: {source}; check the path and free space")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("packet-bytes record of {0} bytes, expected {1}")]
    Size(usize, usize),
    #[error("packet-bytes record of unknown kind {0}")]
    Kind(u8),
}

/// Decodes one record of the probes' `PACKETS` ring buffer.
pub fn decode(raw: &[u8]) -> Result<PacketBytes, PcapngError> {
    if raw.len() != size_of::<PacketBytes>() {
        return Err(PcapngError::Size(raw.len(), size_of::<PacketBytes>()));
    }
    // SAFETY: PacketBytes is repr(C) plain integers of exactly this size; read_unaligned
    // copes with any alignment of the slice.
    let p: PacketBytes = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
    if p.kind != kind::PACKET_BYTES {
        return Err(PcapngError::Kind(p.kind));
    }
    Ok(p)
}

/// The packet's bytes as captured and its length on the wire (from the network header):
/// the IP header's own length when it has one, else the skb's.
pub fn packet_view(p: &PacketBytes) -> (&[u8], u32) {
    let d = &p.data;
    let from_ip = match d[0] >> 4 {
        4 => u32::from(u16::from_be_bytes([d[2], d[3]])),
        // A zero payload length is a jumbogram (or a GSO aggregate): the skb says.
        6 => match u16::from_be_bytes([d[4], d[5]]) {
            0 => 0,
            n => 40 + u32::from(n),
        },
        _ => 0,
    };
    let orig = if from_ip >= 20 { from_ip } else { p.skb_len };
    // `linear` wraps to a huge value if the kernel's offsets were odd: the cap holds.
    let cap = (p.linear as usize).min(PACKET_BYTES).min(orig as usize);
    (&d[..cap], orig)
}

/// Packet bytes waiting for their traversal's record, by (skb address, start time).
pub struct PacketStore {
    map: HashMap<(u64, u64), PacketBytes>,
    order: VecDeque<(u64, u64)>,
    cap: usize,
    /// Bytes dropped unused to stay within the bound (their traversal was left out by the
    /// filter, or is still in flight after that many others started).
    pub evicted: u64,
}

impl PacketStore {
    /// Holds at most `cap` packets (160 bytes each).
    pub fn new(cap: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap,
            evicted: 0,
        }
    }

    pub fn insert(&mut self, p: PacketBytes) {
        let key = (p.skb, p.ts_first);
        if self.map.insert(key, p).is_none() {
            self.order.push_back(key);
        }
        while self.map.len() > self.cap {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if self.map.remove(&old).is_some() {
                self.evicted += 1;
            }
        }
    }

    /// The bytes of the traversal of `skb` started at `ts_first`, taken out.
    pub fn take(&mut self, skb: u64, ts_first: u64) -> Option<PacketBytes> {
        let p = self.map.remove(&(skb, ts_first))?;
        // The order entry goes when it reaches the front (its map entry is gone by then).
        if self.order.len() > 2 * self.cap.max(1) {
            let map = &self.map;
            self.order.retain(|k| map.contains_key(k));
        }
        Some(p)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What `--pcapng` wrote, in traversals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PcapngStats {
    /// Packets written (with or without their bytes).
    pub packets: u64,
    /// Of those, written without bytes: the probes could not write them or they were not
    /// found (see `bytes_lost`).
    pub without_bytes: u64,
    /// Packets whose bytes the probes could not write (their ring buffer was full or the
    /// packet unreadable), counted in the kernel, whether printed or not.
    pub bytes_lost: u64,
    /// Traversals printed but not written to the file (it could not be written).
    pub failed: u64,
}

/// A pcap-ng file being written.
pub struct PcapngWriter {
    path: PathBuf,
    out: super::StoppingFile,
    interfaces: HashMap<String, u32>,
    pub stats: PcapngStats,
}

impl PcapngWriter {
    pub fn create(path: &Path) -> Result<Self, PcapngError> {
        let file = std::fs::File::create(path).map_err(|source| PcapngError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::to_writer(path, Box::new(file))
    }

    /// Writes the section header to `w` (`path` names it in messages).
    pub fn to_writer(path: &Path, w: Box<dyn Write + Send>) -> Result<Self, PcapngError> {
        let mut out = BufWriter::new(w);
        let mut body = Vec::new();
        body.extend_from_slice(&0x1A2B_3C4Du32.to_ne_bytes());
        body.extend_from_slice(&1u16.to_ne_bytes());
        body.extend_from_slice(&0u16.to_ne_bytes());
        // Section length: unspecified.
        body.extend_from_slice(&(-1i64).to_ne_bytes());
        // shb_userappl
        option(
            &mut body,
            4,
            format!("observer {}", env!("CARGO_PKG_VERSION")).as_bytes(),
        );
        end_of_options(&mut body);
        block(&mut out, 0x0A0D_0D0A, &body).map_err(|source| PcapngError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Ok(Self {
            path: path.into(),
            out: Some(out),
            interfaces: HashMap::new(),
            stats: PcapngStats::default(),
        })
    }

    /// The interface block's index for `name`, written when first needed.
    fn interface(&mut self, name: &str) -> std::io::Result<u32> {
        if let Some(&id) = self.interfaces.get(name) {
            return Ok(id);
        }
        let mut body = Vec::new();
        body.extend_from_slice(&LINKTYPE_RAW.to_ne_bytes());
        body.extend_from_slice(&0u16.to_ne_bytes());
        body.extend_from_slice(&(PACKET_BYTES as u32).to_ne_bytes());
        // if_name, and if_tsresol 9: timestamps in nanoseconds.
        option(&mut body, 2, name.as_bytes());
        option(&mut body, 9, &[9]);
        end_of_options(&mut body);
        block(self.out.as_mut().expect("checked by the caller"), 1, &body)?;
        let id = self.interfaces.len() as u32;
        self.interfaces.insert(name.to_string(), id);
        Ok(id)
    }

    /// Writes one traversal's packet: `bytes` (None when they are missing: written empty,
    /// said in the comment, counted), seen on `iface` at `ts_ns` (Unix ns).
    pub fn write(&mut self, iface: &str, ts_ns: u64, bytes: Option<&PacketBytes>, comment: &str) {
        if self.out.is_none() {
            self.stats.failed += 1;
            return;
        }
        let (data, orig, comment) = match bytes {
            Some(p) => {
                let (d, o) = packet_view(p);
                (d, o, comment.to_string())
            }
            None => (
                &[][..],
                0,
                format!("[packet bytes lost: the probes could not write them] {comment}"),
            ),
        };
        let result = self.interface(iface).and_then(|id| {
            let mut body = Vec::with_capacity(64 + data.len() + comment.len());
            body.extend_from_slice(&id.to_ne_bytes());
            body.extend_from_slice(&((ts_ns >> 32) as u32).to_ne_bytes());
            body.extend_from_slice(&(ts_ns as u32).to_ne_bytes());
            body.extend_from_slice(&(data.len() as u32).to_ne_bytes());
            body.extend_from_slice(&orig.to_ne_bytes());
            body.extend_from_slice(data);
            pad(&mut body);
            // opt_comment
            option(&mut body, 1, comment.trim_end().as_bytes());
            end_of_options(&mut body);
            block(self.out.as_mut().expect("checked above"), 6, &body)
        });
        match result {
            Ok(()) => {
                self.stats.packets += 1;
                self.stats.without_bytes += u64::from(bytes.is_none());
            }
            Err(e) => {
                log::warn!(
                    "writing the pcap-ng file {} failed ({e}); it stops here, the packets not \
                     written are counted in the summary",
                    self.path.display()
                );
                self.out = None;
                self.stats.failed += 1;
            }
        }
    }

    /// Hands what is buffered to the file (a write that fails stops it, counted).
    pub fn flush(&mut self) {
        super::flush_or_stop(&mut self.out, "the pcap-ng file", &self.path);
    }

    /// Flushes the file; false if its end could not be written.
    pub fn finish(&mut self) -> bool {
        super::finish_file(&mut self.out, "the pcap-ng file", &self.path)
    }
}

fn pad(buf: &mut Vec<u8>) {
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

fn option(buf: &mut Vec<u8>, code: u16, value: &[u8]) {
    // An option holds at most 65535 bytes; comments and names are far shorter.
    let value = &value[..value.len().min(u16::MAX as usize)];
    buf.extend_from_slice(&code.to_ne_bytes());
    buf.extend_from_slice(&(value.len() as u16).to_ne_bytes());
    buf.extend_from_slice(value);
    pad(buf);
}

fn end_of_options(buf: &mut Vec<u8>) {
    buf.extend_from_slice(&[0, 0, 0, 0]);
}

fn block(out: &mut impl Write, kind: u32, body: &[u8]) -> std::io::Result<()> {
    let total = (12 + body.len()) as u32;
    out.write_all(&kind.to_ne_bytes())?;
    out.write_all(&total.to_ne_bytes())?;
    out.write_all(body)?;
    out.write_all(&total.to_ne_bytes())
}

/// Nanoseconds to add to a `CLOCK_MONOTONIC` time (the probes' clock) for Unix time.
pub fn monotonic_to_unix() -> u64 {
    let now = |clock| {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: ts is a valid timespec.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    now(libc::CLOCK_REALTIME).saturating_sub(now(libc::CLOCK_MONOTONIC))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(skb: u64, ts: u64, ip: &[u8], skb_len: u32, linear: u32) -> PacketBytes {
        let mut p = PacketBytes {
            kind: kind::PACKET_BYTES,
            _pad: [0; 3],
            skb_len,
            linear,
            _pad2: 0,
            skb,
            ts_first: ts,
            data: [0xee; PACKET_BYTES],
        };
        p.data[..ip.len()].copy_from_slice(ip);
        p
    }

    /// An IPv4 UDP header of a `total`-byte datagram.
    fn ipv4(total: u16) -> Vec<u8> {
        let mut h = vec![
            0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2,
        ];
        h[2..4].copy_from_slice(&total.to_be_bytes());
        h
    }

    #[test]
    fn captured_length_is_the_packet_not_the_buffer() {
        // A 60-byte packet: the 68 bytes read past it are not the packet's.
        let p = bytes(1, 1, &ipv4(60), 74, 60);
        let (d, orig) = packet_view(&p);
        assert_eq!((d.len(), orig), (60, 60));
        // A 1500-byte packet, all linear: 128 bytes kept, its length said.
        let p = bytes(1, 1, &ipv4(1500), 1500, 1500);
        assert_eq!(packet_view(&p).0.len(), PACKET_BYTES);
        assert_eq!(packet_view(&p).1, 1500);
        // Paged data: only the linear part is there to keep.
        let p = bytes(1, 1, &ipv4(1500), 1500, 40);
        assert_eq!(packet_view(&p).0.len(), 40);
        // IPv6: payload length + 40; a jumbogram's zero falls back to the skb's length.
        let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        v6.extend([0; 32]);
        assert_eq!(packet_view(&bytes(1, 1, &v6, 48, 48)).1, 48);
        v6[4..6].copy_from_slice(&[0, 0]);
        assert_eq!(packet_view(&bytes(1, 1, &v6, 9000, 128)).1, 9000);
        // Nonsense offsets (linear wrapped) never read past the buffer.
        assert_eq!(
            packet_view(&bytes(1, 1, &ipv4(1500), 1500, u32::MAX))
                .0
                .len(),
            128
        );
    }

    #[test]
    fn decode_checks_size_and_kind() {
        let p = bytes(7, 9, &ipv4(20), 20, 20);
        // SAFETY: plain data.
        let raw = unsafe {
            std::slice::from_raw_parts((&p as *const PacketBytes).cast::<u8>(), size_of_val(&p))
        };
        let back = decode(raw).unwrap();
        assert_eq!((back.skb, back.ts_first), (7, 9));
        assert!(matches!(decode(&raw[1..]), Err(PcapngError::Size(..))));
        let mut other = raw.to_vec();
        other[0] = 3;
        assert!(matches!(decode(&other), Err(PcapngError::Kind(3))));
    }

    #[test]
    fn store_pairs_by_identity_and_stays_bounded() {
        let mut s = PacketStore::new(2);
        s.insert(bytes(1, 10, &ipv4(20), 20, 20));
        s.insert(bytes(1, 20, &ipv4(20), 20, 20));
        assert!(s.take(1, 30).is_none(), "same skb, another traversal");
        assert_eq!(s.take(1, 10).unwrap().ts_first, 10);
        s.insert(bytes(2, 10, &ipv4(20), 20, 20));
        s.insert(bytes(3, 10, &ipv4(20), 20, 20));
        assert_eq!(s.len(), 2);
        assert_eq!(s.evicted, 1, "the oldest waiting one made room");
        assert!(s.take(1, 20).is_none());
        for i in 0..100 {
            s.insert(bytes(10 + i, 1, &ipv4(20), 20, 20));
            s.take(10 + i, 1);
        }
        assert!(s.order.len() <= 5, "taken entries do not pile up");
    }

    /// Reads blocks back: (type, body).
    fn blocks(file: &[u8]) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < file.len() {
            let kind = u32::from_ne_bytes(file[at..at + 4].try_into().unwrap());
            let len = u32::from_ne_bytes(file[at + 4..at + 8].try_into().unwrap()) as usize;
            assert_eq!(len % 4, 0, "blocks are 32-bit aligned");
            let trailer = u32::from_ne_bytes(file[at + len - 4..at + len].try_into().unwrap());
            assert_eq!(trailer as usize, len);
            out.push((kind, file[at + 8..at + len - 4].to_vec()));
            at += len;
        }
        out
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

    #[test]
    fn writes_an_interface_block_per_interface_and_a_comment_per_packet() {
        let buf = Shared::default();
        let mut w = PcapngWriter::to_writer(Path::new("mem"), Box::new(buf.clone())).unwrap();
        let p = bytes(1, 1, &ipv4(28), 28, 28);
        w.write(
            "eth0",
            1_700_000_000_123_456_789,
            Some(&p),
            "ipv4 udp a -> b\n",
        );
        w.write("eth0", 2, Some(&p), "second");
        w.write("cali1a2b", 3, None, "third");
        assert!(w.finish());
        assert_eq!(
            w.stats,
            PcapngStats {
                packets: 3,
                without_bytes: 1,
                bytes_lost: 0,
                failed: 0
            }
        );
        let file = buf.0.lock().unwrap().clone();
        let b = blocks(&file);
        let kinds: Vec<u32> = b.iter().map(|(k, _)| *k).collect();
        assert_eq!(kinds, vec![0x0A0D_0D0A, 1, 6, 6, 1, 6]);
        // Interface blocks: LINKTYPE_RAW, named.
        assert_eq!(u16::from_ne_bytes([b[1].1[0], b[1].1[1]]), LINKTYPE_RAW);
        assert!(b[1].1.windows(4).any(|w| w == b"eth0"));
        assert!(b[4].1.windows(8).any(|w| w == b"cali1a2b"));
        // First packet: interface 0, the time, 28 bytes, its comment without the newline.
        let epb = &b[2].1;
        let word = |i: usize| u32::from_ne_bytes(epb[i * 4..i * 4 + 4].try_into().unwrap());
        assert_eq!(word(0), 0);
        let ts = (u64::from(word(1)) << 32) | u64::from(word(2));
        assert_eq!(ts, 1_700_000_000_123_456_789);
        assert_eq!((word(3), word(4)), (28, 28));
        assert_eq!(&epb[20..40], &ipv4(28)[..]);
        assert_eq!(&epb[40..48], &[0xee; 8]);
        let text = String::from_utf8_lossy(epb);
        assert!(text.contains("ipv4 udp a -> b") && !text.contains("b\n"));
        // The packet without bytes is on the second interface, empty, and says why.
        let epb = &b[5].1;
        assert_eq!(u32::from_ne_bytes(epb[0..4].try_into().unwrap()), 1);
        assert_eq!(u32::from_ne_bytes(epb[12..16].try_into().unwrap()), 0);
        assert!(String::from_utf8_lossy(epb).contains("[packet bytes lost"));
    }
}
