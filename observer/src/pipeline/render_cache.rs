//! Rendered reports by record content: the packets of a flow mostly make records that are
//! identical but for the skb address and the times, and so identical reports. The collector
//! renders such a record once and copies the bytes after that. Entries are keyed by the
//! whole record (compared byte for byte, never trusted to a hash alone), bounded in number,
//! and forgotten when anything else a report depends on changes (interface names, plans).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use observer_common::traversal::TraversalRecord;

/// Entries kept; the cache starts over when full.
pub const ENTRIES: usize = 4096;
/// Bytes kept (renderings and keys); the cache starts over past this: lines that name
/// rules are longer, and memory must stay bounded whatever their length.
pub const BYTES: usize = 32 << 20;

/// A fast hasher for keys made of small integers (FNV-1a); not for untrusted keys that
/// could be chosen to collide (ours come from the kernel's records of our own namespace).
#[derive(Default, Clone)]
pub struct Fnv;

impl BuildHasher for Fnv {
    type Hasher = FnvHasher;
    fn build_hasher(&self) -> FnvHasher {
        FnvHasher(0xcbf2_9ce4_8422_2325)
    }
}

pub struct FnvHasher(u64);

impl Hasher for FnvHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0 = super::keys::fnv1a(self.0, bytes);
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x100_0000_01b3);
    }
}

/// What an entry weighs in bytes, for the cache's bound.
pub trait Weight {
    fn weight(&self) -> usize;
}

impl Weight for bytes::Bytes {
    fn weight(&self) -> usize {
        self.len()
    }
}

pub struct Rendered<V = bytes::Bytes> {
    key: Vec<u8>,
    /// Handed on without a copy (a reference count): the writer copies bytes once.
    pub value: V,
    pub outcome: SummaryFlags,
}

/// What the summary counts of a rendered report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SummaryFlags {
    /// Flagged incomplete.
    pub incomplete: bool,
    /// Some stage's rules disagree with what the kernel did.
    pub rules_disagree: bool,
    /// Some stage's rules could not be decided.
    pub rules_undecidable: bool,
}

impl SummaryFlags {
    pub fn of(t: &observer_model::Traversal) -> Self {
        let checked = |r| {
            t.stages
                .iter()
                .any(|s| s.check.as_ref().is_some_and(|c| c.result == r))
        };
        Self {
            incomplete: t.incomplete,
            rules_disagree: checked(observer_model::CheckResult::Disagrees),
            rules_undecidable: checked(observer_model::CheckResult::Undecidable),
        }
    }
}

pub struct RenderCache<V = bytes::Bytes> {
    map: HashMap<u64, Rendered<V>, Fnv>,
    /// Bytes held by the entries.
    held: usize,
    pub hits: u64,
}

/// The record's written bytes as a report depends on them: all but the skb address and the
/// times, which sit together after the head's first 16 bytes. Borrowed, not copied: at line
/// rate the collector looks up every record.
fn key_parts(rec: &TraversalRecord) -> (&[u8], &[u8]) {
    const IDENTITY: usize = std::mem::offset_of!(TraversalRecord, skb);
    const AFTER: usize = std::mem::offset_of!(TraversalRecord, location);
    const _: () = assert!(std::mem::offset_of!(TraversalRecord, ts_first) == IDENTITY + 8);
    const _: () = assert!(std::mem::offset_of!(TraversalRecord, ts_last) == IDENTITY + 16);
    const _: () = assert!(AFTER == IDENTITY + 24);
    const _: () = assert!(observer_common::traversal::RECORD_HEAD_BYTES >= AFTER);
    // SAFETY: plain data; the written length is within the record and past `AFTER`.
    let w = unsafe {
        std::slice::from_raw_parts(
            (rec as *const TraversalRecord).cast::<u8>(),
            rec.written_len(),
        )
    };
    (&w[..IDENTITY], &w[AFTER..])
}

/// Both parts are whole 8-byte words (asserted), taken four at a time into four lanes: a
/// record is ~70 words, and one chain of multiplies through all of them was a fifth of the
/// collector's time.
fn hash((head, rest): (&[u8], &[u8])) -> u64 {
    const _: () = assert!(std::mem::offset_of!(TraversalRecord, skb).is_multiple_of(8));
    const _: () = assert!(observer_common::traversal::RECORD_HEAD_BYTES.is_multiple_of(8));
    const _: () = assert!(observer_common::traversal::STEP_BYTES.is_multiple_of(8));
    let mut lanes: [u64; 4] = [
        0xcbf2_9ce4_8422_2325,
        0x9e37_79b9_7f4a_7c15,
        0xc2b2_ae3d_27d4_eb4f,
        0x1656_67b1_9e37_79f9,
    ];
    absorb(&mut lanes, head);
    absorb(&mut lanes, rest);
    lanes.iter().fold(0, |h: u64, l| {
        (h.rotate_left(23) ^ l).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    })
}

fn absorb(lanes: &mut [u64; 4], bytes: &[u8]) {
    let mix = |h: u64, w: &[u8]| {
        let h =
            (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(0x100_0000_01b3);
        h ^ (h >> 29)
    };
    let [mut a, mut b, mut c, mut d] = *lanes;
    let mut blocks = bytes.chunks_exact(32);
    for x in &mut blocks {
        a = mix(a, &x[..8]);
        b = mix(b, &x[8..16]);
        c = mix(c, &x[16..24]);
        d = mix(d, &x[24..]);
    }
    for (i, w) in blocks.remainder().chunks_exact(8).enumerate() {
        match i {
            0 => a = mix(a, w),
            1 => b = mix(b, w),
            _ => c = mix(c, w),
        }
    }
    *lanes = [a, b, c, d];
}

/// Whether a kept key is `parts`.
fn same_key(key: &[u8], (head, rest): (&[u8], &[u8])) -> bool {
    key.len() == head.len() + rest.len() && key[..head.len()] == *head && key[head.len()..] == *rest
}

impl<V> Default for RenderCache<V> {
    fn default() -> Self {
        Self {
            map: HashMap::default(),
            held: 0,
            hits: 0,
        }
    }
}

impl<V: Weight> RenderCache<V> {
    /// The rendering of `rec`: from the cache, or made by `render` (value, outcome) and
    /// kept.
    pub fn get_or_render(
        &mut self,
        rec: &TraversalRecord,
        render: impl FnOnce() -> (V, SummaryFlags),
    ) -> &Rendered<V> {
        // Hashed and compared in place: a hit copies and allocates nothing.
        let parts = key_parts(rec);
        let h = hash(parts);
        let hit = self.map.get(&h).is_some_and(|e| same_key(&e.key, parts));
        if hit {
            self.hits += 1;
        } else {
            let (value, outcome) = render();
            let key = [parts.0, parts.1].concat();
            let weight = value.weight() + key.len();
            if self.map.len() >= ENTRIES || self.held + weight > BYTES {
                self.clear();
            }
            self.held += weight;
            let replaced = self.map.insert(
                h,
                Rendered {
                    key,
                    value,
                    outcome,
                },
            );
            if let Some(old) = replaced {
                self.held -= old.value.weight() + old.key.len();
            }
        }
        &self.map[&h]
    }

    /// Counts `n` more bytes held by an entry (a rendering made after it was kept); past
    /// the bound the cache starts over.
    pub fn add_weight(&mut self, n: usize) {
        self.held += n;
        if self.held > BYTES {
            self.clear();
        }
    }

    /// Forgets everything (names or plans changed).
    pub fn clear(&mut self) {
        self.map.clear();
        self.held = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(skb: u64, mark: u32) -> TraversalRecord {
        // SAFETY: all-zero is a valid record.
        let mut r: TraversalRecord = unsafe { std::mem::zeroed() };
        observer_common::traversal::start(&mut r, skb, skb * 10, 0);
        r.nsteps = 1;
        r.steps[0].mark = mark;
        r
    }

    #[test]
    fn records_differing_only_in_identity_and_time_share_a_rendering() {
        let mut c = RenderCache::<bytes::Bytes>::default();
        let calls = std::cell::Cell::new(0);
        let render = |m: u32| {
            calls.set(calls.get() + 1);
            (format!("mark {m}\n").into(), SummaryFlags::default())
        };
        assert_eq!(
            c.get_or_render(&rec(1, 5), || render(5)).value,
            &b"mark 5\n"[..]
        );
        assert_eq!(
            c.get_or_render(&rec(2, 5), || render(5)).value,
            &b"mark 5\n"[..]
        );
        assert_eq!(
            c.get_or_render(&rec(3, 6), || render(6)).value,
            &b"mark 6\n"[..]
        );
        assert_eq!(calls.get(), 2);
        assert_eq!(c.hits, 1);
        c.clear();
        c.get_or_render(&rec(4, 5), || render(5));
        assert_eq!(calls.get(), 3);
    }

    #[test]
    fn any_other_field_before_or_after_the_identity_and_times_makes_another_rendering() {
        let mut c = RenderCache::<bytes::Bytes>::default();
        let calls = std::cell::Cell::new(0);
        let mut render = |r: &TraversalRecord| {
            c.get_or_render(r, || {
                calls.set(calls.get() + 1);
                (bytes::Bytes::from_static(b"x\n"), SummaryFlags::default())
            });
        };
        let base = rec(1, 5);
        render(&base);
        let mut reason = base;
        reason.reason = 7;
        render(&reason);
        let mut location = base;
        location.location = 0xffff_ffff_8100_0000;
        render(&location);
        let mut last_step = base;
        last_step.steps[0].len = 99;
        render(&last_step);
        // A step past the written ones is not part of the record.
        let mut unwritten = base;
        unwritten.steps[1].len = 99;
        render(&unwritten);
        assert_eq!(calls.get(), 4);
    }

    #[test]
    fn memory_stays_bounded_whatever_the_length_of_the_lines() {
        let mut c = RenderCache::<bytes::Bytes>::default();
        for i in 0..40 {
            c.get_or_render(&rec(i + 1, i as u32), || {
                (vec![b'x'; 1 << 20].into(), SummaryFlags::default())
            });
            assert!(c.held <= BYTES, "{} bytes held", c.held);
        }
        assert!(c.map.len() <= BYTES >> 20);
    }
}
