//! Netfilter BPF programs and links, the one thing Aya 0.14 cannot load.
//!
//! Aya rejects any object with a `netfilter` section, so this module parses such an object
//! itself, points its map references at maps that Aya already created (by symbol name), loads
//! each program with `BPF_PROG_LOAD` (type `BPF_PROG_TYPE_NETFILTER`) and attaches it with
//! `BPF_LINK_CREATE`. The interface mirrors Aya's (`load`, `attach`, link detached on drop)
//! so that it can be replaced by Aya's own once Aya supports netfilter programs.
//!
//! Scope: programs must be self-contained (no BPF-to-BPF calls, no global data); the only
//! relocations allowed are `ld_imm64` map references. Anything else is refused with an error
//! that says so, instead of loading a program that would misbehave.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use aya_obj::generated::{BPF_PSEUDO_MAP_FD, bpf_attach_type, bpf_attr, bpf_cmd, bpf_prog_type};
use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget};

/// Size of one BPF instruction.
const INSN: usize = 8;
/// `BPF_LD | BPF_IMM | BPF_DW`: the first half of a 64-bit immediate load.
const LD_IMM64: u8 = 0x18;

#[derive(Debug, thiserror::Error)]
pub enum NfError {
    #[error("netfilter object is not a valid ELF: {0}")]
    Elf(object::Error),
    #[error("netfilter object has no program named `{0}`")]
    NoProgram(String),
    #[error(
        "program `{prog}` references `{symbol}`, which is not a map observer created; only map \
         references are supported (mark helpers #[inline(always)], avoid global data)"
    )]
    UnsupportedRelocation { prog: String, symbol: String },
    #[error("program `{prog}` has a relocation at byte {offset} that is not an ld_imm64")]
    BadRelocation { prog: String, offset: u64 },
    #[error(
        "program `{prog}` has a field placeholder at instruction {insn} that the loader cannot \
         resolve ({what}); the probe object and observer must come from the same build"
    )]
    Placeholder {
        prog: String,
        insn: usize,
        what: String,
    },
    #[error(
        "the kernel refused to load netfilter program `{prog}`: {error}\n\
         verifier log:\n{log}\n(BPF netfilter programs need Linux 6.4+ with \
         CONFIG_NETFILTER_BPF_LINK=y and root or CAP_BPF+CAP_NET_ADMIN)"
    )]
    Load {
        prog: String,
        // Not `source`: the message already says it, and a source would be printed again.
        error: std::io::Error,
        log: String,
    },
    #[error(
        "the kernel refused to load trampoline program `{prog}`: {error}\n\
         verifier log:\n{log}"
    )]
    LoadTraced {
        prog: String,
        // Not `source`: the message already says it, and a source would be printed again.
        error: std::io::Error,
        log: String,
    },
    #[error("program `{0}` must be loaded before it is attached")]
    NotLoaded(String),
    #[error("cannot attach `{prog}` to {family}/{hook} at priority {priority}: {error}{hint}")]
    Attach {
        prog: String,
        family: &'static str,
        hook: &'static str,
        priority: i32,
        error: std::io::Error,
        hint: &'static str,
    },
}

/// By hand, not `#[from]`: that would make the ELF error the source too, and the message,
/// which already says it, would be followed by it again.
impl From<object::Error> for NfError {
    fn from(e: object::Error) -> Self {
        NfError::Elf(e)
    }
}

/// Families and hooks are the model's (`observer-model`): the loader only attaches at them.
pub use observer_model::{Family as NfFamily, Hook as NfHook};

/// One program of a netfilter object, with its map references already resolved.
pub struct NfProgram {
    name: String,
    insns: Vec<u8>,
    license: CString,
    fd: Option<OwnedFd>,
    kind: ProgKind,
}

/// What a program of the object is, by its section's prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgKind {
    /// `netfilter/<name>`: BPF_PROG_TYPE_NETFILTER, attached by a netfilter link.
    Netfilter,
    /// `fentry/<function>` or `fexit/<function>`: BPF_PROG_TYPE_TRACING on a kernel
    /// function (see [`NfProgram::load_traced`]), named by the whole section name.
    Trace { exit: bool },
}

/// The netfilter programs found in an ELF object (sections named `netfilter/<name>`), and
/// the trampoline programs (`fentry/<function>`, `fexit/<function>`).
pub struct NfObject {
    programs: HashMap<String, NfProgram>,
}

impl NfObject {
    /// Parses `elf`, points every map reference at the fd `maps` gives for that symbol, and
    /// puts the kernel's field offsets (`fields`: the config values, by slot) in place of the
    /// probes' placeholders (see `observer_common::direct`). `rdonly_cast` is the BTF id of
    /// the kfunc `bpf_rdonly_cast` where the kernel lets programs load untrusted memory with
    /// it (see `observer_common::kfunc`); `None` keeps the probes on `bpf_probe_read_kernel`.
    pub fn parse(
        elf: &[u8],
        maps: &HashMap<String, RawFd>,
        fields: &[u64],
        rdonly_cast: Option<u32>,
    ) -> Result<Self, NfError> {
        let file = object::File::parse(elf)?;
        let license = file
            .section_by_name("license")
            .and_then(|s| s.data().ok())
            .map(|d| d.split(|&b| b == 0).next().unwrap_or(b"GPL").to_vec())
            .unwrap_or_else(|| b"GPL".to_vec());
        let license = CString::new(license).unwrap_or_else(|_| c"GPL".into());
        let mut programs = HashMap::new();
        for section in file.sections() {
            let Ok(section_name) = section.name() else {
                continue;
            };
            let (prog, kind) = if let Some(p) = section_name.strip_prefix("netfilter/") {
                (p, ProgKind::Netfilter)
            } else if section_name.starts_with("fentry/") {
                (section_name, ProgKind::Trace { exit: false })
            } else if section_name.starts_with("fexit/") {
                (section_name, ProgKind::Trace { exit: true })
            } else {
                continue;
            };
            let mut insns = section.data()?.to_vec();
            for (offset, reloc) in section.relocations() {
                let symbol = match reloc.target() {
                    RelocationTarget::Symbol(idx) => file.symbol_by_index(idx)?,
                    _ => {
                        return Err(NfError::BadRelocation {
                            prog: prog.to_string(),
                            offset,
                        });
                    }
                };
                let name = symbol.name().unwrap_or("?").to_string();
                let Some(&fd) = maps.get(&name) else {
                    return Err(NfError::UnsupportedRelocation {
                        prog: prog.to_string(),
                        symbol: name,
                    });
                };
                patch_map_fd(&mut insns, offset as usize, fd).ok_or_else(|| {
                    NfError::BadRelocation {
                        prog: prog.to_string(),
                        offset,
                    }
                })?;
            }
            patch_fields(&mut insns, fields)
                .and_then(|_| patch_calls(&mut insns, rdonly_cast))
                .map_err(|(insn, what)| NfError::Placeholder {
                    prog: prog.to_string(),
                    insn,
                    what,
                })?;
            programs.insert(
                prog.to_string(),
                NfProgram {
                    name: prog.to_string(),
                    insns,
                    license: license.clone(),
                    fd: None,
                    kind,
                },
            );
        }
        Ok(Self { programs })
    }

    pub fn program_mut(&mut self, name: &str) -> Result<&mut NfProgram, NfError> {
        self.programs
            .get_mut(name)
            .ok_or_else(|| NfError::NoProgram(name.to_string()))
    }
}

/// Puts field offsets in place of placeholders: in every memory load whose offset is one
/// (`observer_common::direct`). A placeholder left anywhere else (the compiler folded it
/// into arithmetic) or naming a slot without a value is an error, with the instruction.
fn patch_fields(insns: &mut [u8], fields: &[u64]) -> Result<usize, (usize, String)> {
    use observer_common::direct;
    const CLASS_LDX: u8 = 0x01;
    const MODE_MEM: u8 = 0x60;
    const ALU64_ADD_K: u8 = 0x07;
    const ALU_ADD_K: u8 = 0x04;
    patch_insns(insns, |i, insn| {
        let op = insn[0];
        let off = i16::from_le_bytes([insn[2], insn[3]]);
        let imm = imm_of(insn);
        if op & 0x07 == CLASS_LDX && op & 0xe0 == MODE_MEM && off > 0 {
            if let Some(slot) = direct::slot_of(off as usize) {
                if !direct::SLOTS.contains(&slot) {
                    return Err((i, format!("slot {slot} is not a direct field")));
                }
                let real = fields
                    .get(slot as usize)
                    .copied()
                    .filter(|&v| v < direct::BASE as u64)
                    .ok_or_else(|| (i, format!("no offset for slot {slot}")))?;
                insn[2..4].copy_from_slice(&(real as i16).to_le_bytes());
                return Ok(true);
            }
        } else if (op == ALU64_ADD_K || op == ALU_ADD_K)
            && imm > 0
            && direct::slot_of(imm as usize).is_some_and(|s| direct::SLOTS.contains(&s))
        {
            return Err((i, format!("placeholder added in opcode {op:#04x}")));
        }
        Ok(false)
    })
}

/// Calls `patch` with the index and bytes of every instruction of `insns` (the second half
/// of an `ld_imm64` is not one), which says whether it rewrote it; stops at its first
/// error. Returns how many were rewritten.
fn patch_insns(
    insns: &mut [u8],
    mut patch: impl FnMut(usize, &mut [u8]) -> Result<bool, (usize, String)>,
) -> Result<usize, (usize, String)> {
    let (mut i, mut patched) = (0, 0);
    while i + INSN <= insns.len() {
        let insn = &mut insns[i..i + INSN];
        let wide = insn[0] == LD_IMM64;
        patched += usize::from(patch(i / INSN, insn)?);
        i += if wide { 2 * INSN } else { INSN };
    }
    Ok(patched)
}

/// An instruction's 32-bit immediate.
fn imm_of(insn: &[u8]) -> i32 {
    i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]])
}

/// An ELF object's bytes in 8-byte aligned memory, as the ELF parser wants them.
pub struct AlignedObject {
    words: Vec<u64>,
    len: usize,
}

impl AlignedObject {
    fn copy_of(elf: &[u8]) -> Self {
        let mut words = vec![0u64; elf.len().div_ceil(8)];
        // SAFETY: `words` holds at least `elf.len()` bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, elf.len()) }
            .copy_from_slice(elf);
        Self {
            words,
            len: elf.len(),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the words hold `len` bytes (and up to 7 zero bytes after them).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
}

/// The TC object's sections whose programs load fields directly (`observer_common::direct`,
/// from a tracepoint's typed pointers): their placeholders get the BTF offsets, as the
/// netfilter object's do ([`patch_fields`]). Only these: elsewhere in that object a load
/// at such an offset would be another struct's field.
pub const TC_DIRECT_SECTIONS: [&str; 1] = ["tp_btf/kfree_skb"];

/// A copy of the ELF object `elf` (the TC object, which Aya loads) with the placeholder
/// calls of its code sections rewritten as [`patch_calls`] does for the netfilter object,
/// so that its programs read as the netfilter probes do, and the field placeholders of
/// [`TC_DIRECT_SECTIONS`] replaced by the offsets in `fields` (the config). Aya passes
/// kfunc calls through.
pub fn patch_object_calls(
    elf: &[u8],
    rdonly_cast: Option<u32>,
    fields: &[u64],
) -> Result<AlignedObject, NfError> {
    let file = object::File::parse(elf)?;
    let mut copy = AlignedObject::copy_of(elf);
    let bytes = copy.bytes_mut();
    let mut direct_sections = 0;
    for section in file.sections() {
        if section.kind() != object::SectionKind::Text {
            continue;
        }
        let Some((start, len)) = section.file_range() else {
            continue;
        };
        let (start, len) = (start as usize, len as usize);
        let name = section.name().unwrap_or("?").to_string();
        let code = bytes
            .get_mut(start..start + len)
            .ok_or_else(|| NfError::BadRelocation {
                prog: name.clone(),
                offset: start as u64,
            })?;
        patch_calls(code, rdonly_cast).map_err(|(insn, what)| NfError::Placeholder {
            prog: name.clone(),
            insn,
            what,
        })?;
        if TC_DIRECT_SECTIONS.contains(&name.as_str()) {
            direct_sections += 1;
            patch_fields(code, fields).map_err(|(insn, what)| NfError::Placeholder {
                prog: name,
                insn,
                what,
            })?;
        }
    }
    if direct_sections != TC_DIRECT_SECTIONS.len() {
        return Err(NfError::NoProgram(format!(
            "one of {TC_DIRECT_SECTIONS:?} (the TC object's direct loads)"
        )));
    }
    Ok(copy)
}

/// Rewrites the probes' placeholder calls (`observer_common::kfunc`) for this kernel: with
/// `rdonly_cast` (the kfunc's BTF id), `DIRECT_READS` becomes `r0 = 1` and `UNTRUSTED` the
/// kfunc call; without, `r0 = 0` and `r0 = r1` (code the verifier then never reaches).
/// Returns how many calls were rewritten.
fn patch_calls(insns: &mut [u8], rdonly_cast: Option<u32>) -> Result<usize, (usize, String)> {
    use observer_common::kfunc;
    const CALL: u8 = 0x85;
    const MOV64_K: u8 = 0xb7;
    const MOV64_X: u8 = 0xbf;
    /// `src_reg` of a call to a kernel function (its BTF id in `imm`, `off` 0: vmlinux).
    const PSEUDO_KFUNC_CALL: u8 = 2;
    patch_insns(insns, |i, insn| {
        let imm = imm_of(insn);
        if insn[0] != CALL || (imm != kfunc::DIRECT_READS && imm != kfunc::UNTRUSTED) {
            return Ok(false);
        }
        if insn[1] != 0 || insn[2..4] != [0, 0] {
            return Err((i, "placeholder call with operands".into()));
        }
        let new: [u8; INSN] = match (imm, rdonly_cast) {
            (kfunc::DIRECT_READS, cast) => {
                let on = i32::from(cast.is_some()).to_le_bytes();
                [MOV64_K, 0, 0, 0, on[0], on[1], on[2], on[3]]
            }
            (_, Some(id)) => {
                let id = id.to_le_bytes();
                [
                    CALL,
                    PSEUDO_KFUNC_CALL << 4,
                    0,
                    0,
                    id[0],
                    id[1],
                    id[2],
                    id[3],
                ]
            }
            // r0 = r1: dst r0 (low nibble), src r1 (high nibble).
            (_, None) => [MOV64_X, 0x10, 0, 0, 0, 0, 0, 0],
        };
        insn.copy_from_slice(&new);
        Ok(true)
    })
}

/// Rewrites the `ld_imm64` at byte `offset` to load map `fd`. None if it is not an ld_imm64.
fn patch_map_fd(insns: &mut [u8], offset: usize, fd: RawFd) -> Option<()> {
    let insn = insns.get_mut(offset..offset + 2 * INSN)?;
    if insn[0] != LD_IMM64 {
        return None;
    }
    // Byte 1 holds dst_reg (low nibble) and src_reg (high nibble), little-endian BPF.
    insn[1] = (insn[1] & 0x0f) | ((BPF_PSEUDO_MAP_FD as u8) << 4);
    insn[4..8].copy_from_slice(&fd.to_le_bytes());
    // The second half's immediate is the offset into the map value: none for map refs.
    insn[12..16].copy_from_slice(&0i32.to_le_bytes());
    Some(())
}

/// The bpf(2) call: its non-negative return, or the error.
fn bpf_syscall(cmd: bpf_cmd, attr: &mut bpf_attr) -> std::io::Result<libc::c_long> {
    // SAFETY: attr is a fully initialised bpf_attr of the size we pass.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            std::mem::size_of::<bpf_attr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(rc)
}

fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> std::io::Result<OwnedFd> {
    let rc = bpf_syscall(cmd, attr)?;
    // SAFETY: on success these commands return a new file descriptor that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as RawFd) })
}

impl NfProgram {
    /// Loads the program into the kernel (idempotent).
    pub fn load(&mut self) -> Result<(), NfError> {
        self.load_as(None)
    }

    /// Loads a trampoline program (`fentry/`, `fexit/`) for the kernel function whose BTF
    /// id is `btf_id`, in the BTF object `btf_obj` (a module's; `None`: vmlinux).
    pub fn load_traced(&mut self, btf_id: u32, btf_obj: Option<RawFd>) -> Result<(), NfError> {
        self.load_as(Some((btf_id, btf_obj)))
    }

    pub fn is_loaded(&self) -> bool {
        self.fd.is_some()
    }

    fn load_as(&mut self, target: Option<(u32, Option<RawFd>)>) -> Result<(), NfError> {
        if self.fd.is_some() {
            return Ok(());
        }
        // OBSERVER_VERIFIER_LOG=FILE: on failure, write the whole instruction-level verifier
        // log there (for developers changing the probes; it can be hundreds of MB).
        let full = std::env::var_os("OBSERVER_VERIFIER_LOG");
        let mut log = vec![0u8; if full.is_some() { 1 << 29 } else { 1 << 20 }];
        let mut result = self.load_with_log(&mut [], 0, target);
        if result.is_err() {
            // Retry with the verifier log so the error says why.
            result = self.load_with_log(&mut log, if full.is_some() { 2 } else { 1 }, target);
            if let (Err(_), Some(path)) = (&result, &full) {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let _ = std::fs::write(path, &log[..end]);
            }
        }
        match result {
            Ok(fd) => {
                self.fd = Some(fd);
                Ok(())
            }
            Err(source) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let text = String::from_utf8_lossy(&log[..end]);
                // The tail of the verifier log holds the reason.
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(30)..].join("\n");
                let (prog, error, log) = (self.name.clone(), source, tail);
                Err(match self.kind {
                    ProgKind::Netfilter => NfError::Load { prog, error, log },
                    ProgKind::Trace { .. } => NfError::LoadTraced { prog, error, log },
                })
            }
        }
    }

    fn load_with_log(
        &self,
        log: &mut [u8],
        level: u32,
        target: Option<(u32, Option<RawFd>)>,
    ) -> std::io::Result<OwnedFd> {
        // SAFETY: bpf_attr is a plain C union; all-zero is its documented initial state.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the prog-load member of a zeroed union.
        let load = unsafe { &mut attr.__bindgen_anon_3 };
        match (self.kind, target) {
            (ProgKind::Trace { exit }, Some((btf_id, obj))) => {
                load.prog_type = bpf_prog_type::BPF_PROG_TYPE_TRACING as u32;
                load.expected_attach_type = if exit {
                    bpf_attach_type::BPF_TRACE_FEXIT
                } else {
                    bpf_attach_type::BPF_TRACE_FENTRY
                } as u32;
                load.attach_btf_id = btf_id;
                if let Some(fd) = obj {
                    load.__bindgen_anon_1.attach_btf_obj_fd = fd as u32;
                }
            }
            (ProgKind::Netfilter, None) => {
                load.prog_type = bpf_prog_type::BPF_PROG_TYPE_NETFILTER as u32;
                load.expected_attach_type = bpf_attach_type::BPF_NETFILTER as u32;
            }
            _ => return Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        }
        load.insns = self.insns.as_ptr() as u64;
        load.insn_cnt = (self.insns.len() / INSN) as u32;
        load.license = self.license.as_ptr() as u64;
        // The kernel takes letters, digits, `_` and `.` in a program's name.
        let kernel_name = self.name.replace('/', "_");
        for (dst, src) in load.prog_name.iter_mut().zip(kernel_name.bytes().take(15)) {
            *dst = src as libc::c_char;
        }
        if level > 0 {
            load.log_level = level;
            load.log_buf = log.as_mut_ptr() as u64;
            load.log_size = log.len() as u32;
        }
        bpf(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    }

    /// Attaches the program at (family, hook, priority) in the calling thread's network
    /// namespace. The returned link detaches when dropped (or when the process dies).
    pub fn attach(&self, family: NfFamily, hook: NfHook, priority: i32) -> Result<NfLink, NfError> {
        let fd = self
            .fd
            .as_ref()
            .ok_or_else(|| NfError::NotLoaded(self.name.clone()))?;
        // SAFETY: as in load_with_log.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the link-create member of a zeroed union.
        let link = unsafe { &mut attr.link_create };
        link.__bindgen_anon_1.prog_fd = fd.as_raw_fd() as u32;
        link.attach_type = bpf_attach_type::BPF_NETFILTER as u32;
        link.__bindgen_anon_3.netfilter.pf = family.pf();
        link.__bindgen_anon_3.netfilter.hooknum = hook as u32;
        link.__bindgen_anon_3.netfilter.priority = priority;
        link.__bindgen_anon_3.netfilter.flags = 0;
        match bpf(bpf_cmd::BPF_LINK_CREATE, &mut attr) {
            Ok(fd) => Ok(NfLink {
                _fd: fd,
                family,
                hook,
                priority,
            }),
            Err(source) => {
                let hint = match source.raw_os_error() {
                    Some(libc::EBUSY) => " (another BPF netfilter program holds this priority)",
                    Some(libc::ERANGE) => {
                        " (priority out of range: INT_MIN and INT_MAX are reserved)"
                    }
                    Some(libc::EINVAL) => " (kernel 6.4+ with CONFIG_NETFILTER_BPF_LINK=y needed)",
                    Some(libc::EPERM) => " (run as root)",
                    _ => "",
                };
                Err(NfError::Attach {
                    prog: self.name.clone(),
                    family: family.name(),
                    hook: hook.name(),
                    priority,
                    error: source,
                    hint,
                })
            }
        }
    }
}

impl NfProgram {
    /// Attaches a loaded trampoline program to its function (`BPF_RAW_TRACEPOINT_OPEN`
    /// without a name: the target given at load). Closing the fd detaches it.
    pub fn attach_traced(&self) -> std::io::Result<OwnedFd> {
        let fd = self
            .fd
            .as_ref()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        // SAFETY: as in load_with_log.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: writing the raw-tracepoint member of a zeroed union.
        let rt = unsafe { &mut attr.raw_tracepoint };
        rt.name = 0;
        rt.prog_fd = fd.as_raw_fd() as u32;
        bpf(bpf_cmd::BPF_RAW_TRACEPOINT_OPEN, &mut attr)
    }
}

/// A BPF hash map of `key_size`-byte keys and `value_size`-byte values, `max` entries.
pub fn create_hash_map(
    name: &str,
    key_size: u32,
    value_size: u32,
    max: u32,
) -> std::io::Result<OwnedFd> {
    // SAFETY: as in load_with_log.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the map-create member of a zeroed union.
    let m = unsafe { &mut attr.__bindgen_anon_1 };
    m.map_type = aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_HASH as u32;
    m.key_size = key_size;
    m.value_size = value_size;
    m.max_entries = max;
    for (dst, src) in m.map_name.iter_mut().zip(name.bytes().take(15)) {
        *dst = src as libc::c_char;
    }
    bpf(bpf_cmd::BPF_MAP_CREATE, &mut attr)
}

/// Sets `key` to `value` in map `fd` (both plain data of the map's sizes).
pub fn map_update<K: Copy, V: Copy>(fd: RawFd, key: &K, value: &V) -> std::io::Result<()> {
    // SAFETY: as in load_with_log.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the map-elem member of a zeroed union.
    let e = unsafe { &mut attr.__bindgen_anon_2 };
    e.map_fd = fd as u32;
    e.key = key as *const K as u64;
    e.__bindgen_anon_1.value = value as *const V as u64;
    e.flags = 0;
    bpf_rc(bpf_cmd::BPF_MAP_UPDATE_ELEM, &mut attr)
}

/// Removes `key` from map `fd` (absent: fine).
pub fn map_delete<K: Copy>(fd: RawFd, key: &K) -> std::io::Result<()> {
    // SAFETY: as in load_with_log.
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: writing the map-elem member of a zeroed union.
    let e = unsafe { &mut attr.__bindgen_anon_2 };
    e.map_fd = fd as u32;
    e.key = key as *const K as u64;
    match bpf_rc(bpf_cmd::BPF_MAP_DELETE_ELEM, &mut attr) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

/// The fd of the kernel's BTF object named `name` (a module's: `nf_tables`), if loaded.
pub fn kernel_btf_fd(name: &str) -> std::io::Result<Option<OwnedFd>> {
    let mut id = 0u32;
    loop {
        // SAFETY: as in load_with_log.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        attr.__bindgen_anon_6.__bindgen_anon_1.start_id = id;
        match bpf_rc(bpf_cmd::BPF_BTF_GET_NEXT_ID, &mut attr) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
            Err(e) => return Err(e),
        }
        // SAFETY: the kernel filled it.
        id = unsafe { attr.__bindgen_anon_6.next_id };
        // SAFETY: as in load_with_log.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        attr.__bindgen_anon_6.__bindgen_anon_1.btf_id = id;
        let fd = match bpf(bpf_cmd::BPF_BTF_GET_FD_BY_ID, &mut attr) {
            Ok(fd) => fd,
            // Gone meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => continue,
            Err(e) => return Err(e),
        };
        let mut buf = [0u8; 64];
        // SAFETY: plain data, all-zero valid.
        let mut info: aya_obj::generated::bpf_btf_info = unsafe { std::mem::zeroed() };
        info.name = buf.as_mut_ptr() as u64;
        info.name_len = buf.len() as u32;
        // SAFETY: as in load_with_log.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        attr.info.bpf_fd = fd.as_raw_fd() as u32;
        attr.info.info_len = std::mem::size_of_val(&info) as u32;
        attr.info.info = &mut info as *mut _ as u64;
        bpf_rc(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if info.kernel_btf != 0 && &buf[..end] == name.as_bytes() {
            return Ok(Some(fd));
        }
    }
}

/// A bpf command that returns 0 on success (no fd).
fn bpf_rc(cmd: bpf_cmd, attr: &mut bpf_attr) -> std::io::Result<()> {
    bpf_syscall(cmd, attr).map(|_| ())
}

/// Whether the kernel loads netfilter programs at all: a trivial one (`r0 = NF_ACCEPT;
/// exit`) is loaded and released at once. EINVAL: the program type is not there (before
/// Linux 6.4, or without CONFIG_NETFILTER_BPF_LINK); EPERM: not privileged enough.
pub fn load_trivial_program() -> std::io::Result<()> {
    let mut insns = vec![0xb7, 0, 0, 0, 1, 0, 0, 0];
    insns.extend([0x95, 0, 0, 0, 0, 0, 0, 0]);
    let program = NfProgram {
        name: "observer_probe".into(),
        insns,
        license: c"GPL".into(),
        fd: None,
        kind: ProgKind::Netfilter,
    };
    program.load_with_log(&mut [], 0, None).map(drop)
}

/// Whether the kernel runs trampolines: a trivial fentry program (`r0 = 0; exit`) on the
/// vmlinux function whose BTF id is `btf_id` is loaded, attached and released at once.
pub fn trial_trampoline(btf_id: u32) -> std::io::Result<()> {
    let mut program = NfProgram {
        name: "observer_trial".into(),
        insns: vec![0xb7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0],
        license: c"GPL".into(),
        fd: None,
        kind: ProgKind::Trace { exit: false },
    };
    program.fd = Some(program.load_with_log(&mut [], 0, Some((btf_id, None)))?);
    program.attach_traced().map(drop)
}

/// An attached netfilter program; closing the fd detaches it.
pub struct NfLink {
    _fd: OwnedFd,
    pub family: NfFamily,
    pub hook: NfHook,
    pub priority: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_placeholders_become_btf_offsets() {
        use observer_common::{config, direct};
        let mut fields = vec![config::UNSET; config::COUNT as usize];
        fields[config::SKB_MARK as usize] = 0xa8;
        let ph = direct::placeholder(config::SKB_MARK) as i16;
        // r0 = *(u32 *)(r1 + placeholder); exit
        let mut insns = vec![0x61, 0x10];
        insns.extend(ph.to_le_bytes());
        insns.extend([0; 4]);
        insns.extend([0x95, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(patch_fields(&mut insns, &fields), Ok(1));
        assert_eq!(i16::from_le_bytes([insns[2], insns[3]]), 0xa8);
        // Patched once, a second pass finds nothing.
        assert_eq!(patch_fields(&mut insns, &fields), Ok(0));
        // A slot without a value, a slot that is not a direct field, and a placeholder
        // folded into arithmetic (r1 += placeholder) are refused.
        let mut unset = vec![0x61, 0x10];
        unset.extend((direct::placeholder(config::SKB_LEN) as i16).to_le_bytes());
        unset.extend([0; 4]);
        assert!(patch_fields(&mut unset, &fields).is_err());
        let mut other = vec![0x61, 0x10];
        other.extend((direct::placeholder(config::CT_MARK) as i16).to_le_bytes());
        other.extend([0; 4]);
        assert!(patch_fields(&mut other, &fields).is_err());
        let mut add = vec![0x07, 0x01, 0, 0];
        add.extend((ph as i32).to_le_bytes());
        assert!(patch_fields(&mut add, &fields).is_err());
    }

    #[test]
    fn placeholder_calls_follow_the_kernel() {
        use observer_common::kfunc;
        let call = |imm: i32| {
            let mut v = vec![0x85, 0, 0, 0];
            v.extend(imm.to_le_bytes());
            v
        };
        let program = || {
            let mut p = call(kfunc::DIRECT_READS);
            p.extend(call(kfunc::UNTRUSTED));
            p.extend(call(14)); // bpf_get_current_pid_tgid: a helper, left alone
            p
        };
        let mut with = program();
        assert_eq!(patch_calls(&mut with, Some(65475)), Ok(2));
        assert_eq!(&with[..8], &[0xb7, 0, 0, 0, 1, 0, 0, 0], "r0 = 1");
        assert_eq!(with[8], 0x85);
        assert_eq!(with[9], 0x20, "src_reg = BPF_PSEUDO_KFUNC_CALL");
        assert_eq!(&with[12..16], &65475i32.to_le_bytes(), "the kfunc's BTF id");
        assert_eq!(&with[16..], &call(14)[..]);
        let mut without = program();
        assert_eq!(patch_calls(&mut without, None), Ok(2));
        assert_eq!(&without[..8], &[0xb7, 0, 0, 0, 0, 0, 0, 0], "r0 = 0");
        assert_eq!(&without[8..16], &[0xbf, 0x10, 0, 0, 0, 0, 0, 0], "r0 = r1");
        // Patched once, a second pass finds nothing.
        assert_eq!(patch_calls(&mut without, None), Ok(0));
    }

    #[test]
    fn patches_ld_imm64_with_map_fd() {
        // r1 = 0 ll (ld_imm64, dst r1), then exit.
        let mut insns = vec![
            0x18, 0x01, 0, 0, 0, 0, 0, 0, /* second half */ 0, 0, 0, 0, 0, 0, 0, 0, 0x95, 0,
            0, 0, 0, 0, 0, 0,
        ];
        patch_map_fd(&mut insns, 0, 42).expect("ld_imm64 patched");
        assert_eq!(insns[1], 0x11, "src_reg = BPF_PSEUDO_MAP_FD, dst_reg kept");
        assert_eq!(&insns[4..8], &42i32.to_le_bytes());
        assert!(
            patch_map_fd(&mut insns, 16, 42).is_none(),
            "exit is not patched"
        );
        assert!(
            patch_map_fd(&mut insns, 20, 42).is_none(),
            "out of range is refused"
        );
    }

    #[test]
    fn refuses_garbage_objects() {
        assert!(matches!(
            NfObject::parse(b"not an elf", &HashMap::new(), &[], None),
            Err(NfError::Elf(_))
        ));
    }

    #[test]
    fn hook_numbers_match_kernel() {
        assert_eq!(NfHook::from_raw(0), Some(NfHook::PreRouting));
        assert_eq!(NfHook::from_raw(4), Some(NfHook::PostRouting));
        assert_eq!(NfHook::from_raw(5), None);
        assert_eq!(NfFamily::Ipv6.pf(), 10);
    }
}
