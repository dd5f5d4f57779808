//! Packet bytes for `observer tail --pcapng`: the first bytes of a packet, from its network
//! header, taken where its traversal starts and written to their own ring buffer
//! (`PACKETS`), apart from the traversal records, whose format they leave as it is. The
//! probes write them only when `config::CAPTURE_BYTES` is set.

/// Bytes kept of each packet (from its network header).
pub const PACKET_BYTES: usize = 128;

/// One packet's first bytes, identified as its traversal is: by skb address and the
/// traversal's start time (`TraversalRecord::skb`, `ts_first`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PacketBytes {
    /// [`crate::kind::PACKET_BYTES`].
    pub kind: u8,
    pub _pad: [u8; 3],
    /// `skb->len` where it was taken (with the link-layer header at TC, without it at the
    /// netfilter hooks).
    pub skb_len: u32,
    /// Bytes in the skb's linear part from the network header on (`tail -
    /// network_header`): what `data` holds of the packet, at most [`PACKET_BYTES`].
    pub linear: u32,
    pub _pad2: u32,
    pub skb: u64,
    pub ts_first: u64,
    /// The packet from its network header; only the first `min(linear, PACKET_BYTES)` bytes
    /// are the packet's.
    pub data: [u8; PACKET_BYTES],
}

const _: () = assert!(core::mem::size_of::<PacketBytes>() == 32 + PACKET_BYTES);
