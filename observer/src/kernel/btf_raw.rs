//! The few questions observer asks the kernel's BTF (a struct member's offset, a struct's
//! size, an enum's values, whether a function exists), answered from the raw bytes of
//! `/sys/kernel/btf/vmlinux` with one index of where each type starts: a few MiB for the
//! whole parse, where a full type graph is tens of MiB (the agent's start-up peak, issue 20).
//! The format is the kernel's (`include/uapi/linux/btf.h`).

use std::collections::HashMap;

const MAGIC: u16 = 0xeb9f;

pub const KIND_INT: u32 = 1;
pub const KIND_PTR: u32 = 2;
pub const KIND_ARRAY: u32 = 3;
pub const KIND_STRUCT: u32 = 4;
pub const KIND_UNION: u32 = 5;
pub const KIND_ENUM: u32 = 6;
pub const KIND_FWD: u32 = 7;
pub const KIND_TYPEDEF: u32 = 8;
pub const KIND_VOLATILE: u32 = 9;
pub const KIND_CONST: u32 = 10;
pub const KIND_RESTRICT: u32 = 11;
pub const KIND_FUNC: u32 = 12;
pub const KIND_FUNC_PROTO: u32 = 13;
pub const KIND_VAR: u32 = 14;
pub const KIND_DATASEC: u32 = 15;
pub const KIND_FLOAT: u32 = 16;
pub const KIND_DECL_TAG: u32 = 17;
pub const KIND_TYPE_TAG: u32 = 18;
pub const KIND_ENUM64: u32 = 19;

/// Where a member lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Byte(u64),
    /// A bitfield (or a member not on a byte boundary).
    Bits,
}

#[derive(Debug, thiserror::Error)]
pub enum RawError {
    #[error("not BTF (magic {0:#x})")]
    Magic(u16),
    #[error("BTF truncated at byte {0}")]
    Truncated(usize),
    #[error("BTF type {0} has unknown kind {1}")]
    Kind(u32, u32),
}

/// Raw kernel BTF and where each type starts.
pub struct RawBtf {
    data: Vec<u8>,
    types: usize,
    strings: usize,
    strings_end: usize,
    /// Byte offset (from `types`) of type id `i + 1`.
    starts: Vec<u32>,
    /// Named types by name, built for the names asked for (one pass per batch).
    by_name: HashMap<String, Vec<u32>>,
}

struct Type {
    name_off: u32,
    kind: u32,
    vlen: u32,
    kind_flag: bool,
    /// Size or referenced type.
    size_or_type: u32,
    /// Offset of the type's trailing data (from the type section's start).
    extra: usize,
}

impl RawBtf {
    pub fn parse(data: Vec<u8>) -> Result<Self, RawError> {
        let u16_at = |o: usize| -> Result<u16, RawError> {
            data.get(o..o + 2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .ok_or(RawError::Truncated(o))
        };
        let u32_at = |o: usize| -> Result<u32, RawError> {
            data.get(o..o + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .ok_or(RawError::Truncated(o))
        };
        let magic = u16_at(0)?;
        if magic != MAGIC {
            return Err(RawError::Magic(magic));
        }
        let hdr_len = u32_at(4)? as usize;
        let (type_off, type_len) = (u32_at(8)? as usize, u32_at(12)? as usize);
        let (str_off, str_len) = (u32_at(16)? as usize, u32_at(20)? as usize);
        let types = hdr_len + type_off;
        let strings = hdr_len + str_off;
        if data.len() < types + type_len || data.len() < strings + str_len {
            return Err(RawError::Truncated(data.len()));
        }
        let mut starts = Vec::new();
        let mut at = 0usize;
        // Bounded by the section's length: every type takes at least 12 bytes.
        while at + 12 <= type_len {
            let info = u32_at(types + at + 4)?;
            let (kind, vlen) = ((info >> 24) & 0x1f, info & 0xffff);
            let extra = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_PTR | KIND_FWD | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT
                | KIND_FUNC | KIND_FLOAT | KIND_TYPE_TAG => 0,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen as usize,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen as usize,
                k => return Err(RawError::Kind(starts.len() as u32 + 1, k)),
            };
            starts.push(at as u32);
            at += 12 + extra;
        }
        Ok(Self {
            data,
            types,
            strings,
            strings_end: strings + str_len,
            starts,
            by_name: HashMap::new(),
        })
    }

    /// The BTF's bytes as parsed (for [`RawBtf::parse`], the data it was given: a module's
    /// split BTF is parsed on top of them).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// A module's split BTF (`split`: types numbered after `base`'s, strings offset by
    /// `base`'s) parsed with its base (`base`: vmlinux's), as one BTF: ids and names are
    /// then the kernel's for that module.
    pub fn parse_split(base: &[u8], split: &[u8]) -> Result<Self, RawError> {
        let sections = |d: &[u8]| -> Result<(Vec<u8>, Vec<u8>), RawError> {
            let u32_at = |o: usize| -> Result<usize, RawError> {
                d.get(o..o + 4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                    .ok_or(RawError::Truncated(o))
            };
            let magic = d.get(0..2).map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
            if magic != MAGIC {
                return Err(RawError::Magic(magic));
            }
            let hdr = u32_at(4)?;
            let (to, tl, so, sl) = (u32_at(8)?, u32_at(12)?, u32_at(16)?, u32_at(20)?);
            let types = d
                .get(hdr + to..hdr + to + tl)
                .ok_or(RawError::Truncated(d.len()))?;
            let strings = d
                .get(hdr + so..hdr + so + sl)
                .ok_or(RawError::Truncated(d.len()))?;
            Ok((types.to_vec(), strings.to_vec()))
        };
        let (bt, bs) = sections(base)?;
        let (st, ss) = sections(split)?;
        let (tl, sl) = (bt.len() + st.len(), bs.len() + ss.len());
        let mut data = Vec::with_capacity(24 + tl + sl);
        data.extend(MAGIC.to_le_bytes());
        data.extend([1u8, 0]);
        for v in [24u32, 0, tl as u32, tl as u32, sl as u32] {
            data.extend(v.to_le_bytes());
        }
        data.extend(bt);
        data.extend(st);
        data.extend(bs);
        data.extend(ss);
        Self::parse(data)
    }

    /// The parameter names of function `id` (a FUNC), in order.
    pub fn func_params(&self, id: u32) -> Option<Vec<&str>> {
        let f = self.ty(id)?;
        if f.kind != KIND_FUNC {
            return None;
        }
        let proto = self.ty(f.size_or_type)?;
        if proto.kind != KIND_FUNC_PROTO {
            return None;
        }
        Some(
            (0..proto.vlen as usize)
                .map(|i| self.name(self.u32(proto.extra + 8 * i)))
                .collect(),
        )
    }

    fn u32(&self, o: usize) -> u32 {
        self.data
            .get(o..o + 4)
            .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn name(&self, off: u32) -> &str {
        let start = self.strings + off as usize;
        let Some(rest) = self.data.get(start..self.strings_end) else {
            return "";
        };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    fn ty(&self, id: u32) -> Option<Type> {
        let at = self.types + *self.starts.get((id as usize).checked_sub(1)?)? as usize;
        let info = self.u32(at + 4);
        Some(Type {
            name_off: self.u32(at),
            kind: (info >> 24) & 0x1f,
            vlen: info & 0xffff,
            kind_flag: info >> 31 != 0,
            size_or_type: self.u32(at + 8),
            extra: at + 12,
        })
    }

    /// Indexes the types named `names` (one pass over every type), so that [`RawBtf::id_of`]
    /// finds them without a scan each.
    pub fn index(&mut self, names: &[&str]) {
        let wanted: std::collections::HashSet<&str> = names.iter().copied().collect();
        let mut found: HashMap<String, Vec<u32>> = HashMap::new();
        for id in 1..=self.starts.len() as u32 {
            let Some(t) = self.ty(id) else { continue };
            if t.name_off == 0 {
                continue;
            }
            let n = self.name(t.name_off);
            if wanted.contains(n) {
                found.entry(n.to_string()).or_default().push(id);
            }
        }
        for n in names {
            self.by_name
                .insert(n.to_string(), found.remove(*n).unwrap_or_default());
        }
    }

    /// The id of the type named `name` of one of `kinds`.
    pub fn id_of(&self, name: &str, kinds: &[u32]) -> Option<u32> {
        let matches = |id: u32| {
            self.ty(id)
                .is_some_and(|t| kinds.contains(&t.kind) && self.name(t.name_off) == name)
        };
        match self.by_name.get(name) {
            Some(ids) => ids.iter().copied().find(|&id| matches(id)),
            None => (1..=self.starts.len() as u32).find(|&id| matches(id)),
        }
    }

    /// A type with its modifiers and typedefs taken off (bounded: BTF has no cycles there,
    /// and a chain longer than 32 is refused).
    fn resolve(&self, mut id: u32) -> Option<Type> {
        for _ in 0..32 {
            let t = self.ty(id)?;
            match t.kind {
                KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type;
                }
                _ => return Some(t),
            }
        }
        None
    }

    /// Arguments of the raw tracepoint `name` (`btf_trace_<name>`: a pointer to a function
    /// whose first parameter is the tracepoint's `void *` data, not an argument).
    pub fn tracepoint_args(&self, name: &str) -> Option<usize> {
        let id = self.id_of(&format!("btf_trace_{name}"), &[KIND_TYPEDEF])?;
        let ptr = self.resolve(id)?;
        if ptr.kind != KIND_PTR {
            return None;
        }
        let proto = self.resolve(ptr.size_or_type)?;
        (proto.kind == KIND_FUNC_PROTO).then(|| (proto.vlen as usize).saturating_sub(1))
    }

    /// Bytes of the struct or union `id`.
    pub fn size_of(&self, id: u32) -> Option<usize> {
        let t = self.resolve(id)?;
        matches!(t.kind, KIND_STRUCT | KIND_UNION).then_some(t.size_or_type as usize)
    }

    /// The member `path` (`a.b.c`) of struct or union `id`: each step looks through the
    /// anonymous structs and unions on its way, as C names members.
    pub fn offset_of(&self, id: u32, path: &str) -> Option<Place> {
        let mut t = self.resolve(id)?;
        let mut bits = 0u64;
        let mut steps = path.split('.').peekable();
        while let Some(step) = steps.next() {
            match self.member(&t, step, 0)? {
                (Place::Byte(b), member_type) => {
                    bits += b;
                    if steps.peek().is_some() {
                        t = self.resolve(member_type)?;
                    }
                }
                (Place::Bits, _) => return Some(Place::Bits),
            }
        }
        if !bits.is_multiple_of(8) {
            return Some(Place::Bits);
        }
        Some(Place::Byte(bits / 8))
    }

    /// Member `name` of struct/union `t`: its bit offset (as `Place::Byte` holding bits)
    /// and its type; anonymous members are searched, `depth` levels at most 8.
    fn member(&self, t: &Type, name: &str, depth: u32) -> Option<(Place, u32)> {
        if !matches!(t.kind, KIND_STRUCT | KIND_UNION) || depth > 8 {
            return None;
        }
        for i in 0..t.vlen as usize {
            let m = t.extra + 12 * i;
            let (m_name, m_type, m_off) = (self.u32(m), self.u32(m + 4), self.u32(m + 8));
            let (bit_off, bitfield) = if t.kind_flag {
                (u64::from(m_off & 0x00ff_ffff), m_off >> 24 != 0)
            } else {
                (u64::from(m_off), false)
            };
            if m_name != 0 {
                if self.name(m_name) == name {
                    let place = if bitfield || !bit_off.is_multiple_of(8) {
                        Place::Bits
                    } else {
                        Place::Byte(bit_off)
                    };
                    return Some((place, m_type));
                }
                continue;
            }
            // Anonymous struct or union: its members are this one's.
            if let Some(inner) = self.resolve(m_type)
                && let Some((place, ty)) = self.member(&inner, name, depth + 1)
            {
                return Some((
                    match place {
                        Place::Byte(b) => Place::Byte(b + bit_off),
                        Place::Bits => Place::Bits,
                    },
                    ty,
                ));
            }
        }
        None
    }

    /// The (name, value) pairs of enum `id` (32- or 64-bit; values as u64).
    pub fn enum_values(&self, id: u32) -> Vec<(&str, u64)> {
        let Some(t) = self.ty(id) else {
            return Vec::new();
        };
        let signed = t.kind_flag;
        (0..t.vlen as usize)
            .map(|i| match t.kind {
                KIND_ENUM => {
                    let e = t.extra + 8 * i;
                    let v = self.u32(e + 4);
                    let v = if signed {
                        i64::from(v as i32) as u64
                    } else {
                        u64::from(v)
                    };
                    (self.name(self.u32(e)), v)
                }
                _ => {
                    let e = t.extra + 12 * i;
                    let v = u64::from(self.u32(e + 4)) | (u64::from(self.u32(e + 8)) << 32);
                    (self.name(self.u32(e)), v)
                }
            })
            .filter(|_| matches!(t.kind, KIND_ENUM | KIND_ENUM64))
            .collect()
    }
}
