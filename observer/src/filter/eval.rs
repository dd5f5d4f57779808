//! Evaluation on the host: what the probes' compiled filter decides for a recorded traversal,
//! so that `replay --filter` and the agent's subscribers keep what `tail --filter` would have.

use observer_common::filter::{
    FilterInput, FilterProgram, MAX_INPUTS, eval_any, flow_hash, sample_keep,
};
use observer_common::traversal::{TraversalRecord, step};

use crate::kernel::btf::TupleLayout;
use crate::tuple::tuple as raw_tuple;

/// What the probes' filter decides for `rec`, from what the record holds: the packet as it
/// entered, and its connection's original and reply tuples, as the probes decide after
/// conntrack (docs/filter.md); sampled by the original tuple, as they sample.
pub fn keeps(prog: &FilterProgram, rec: &TraversalRecord, layout: &TupleLayout) -> bool {
    let n = usize::from(rec.nsteps).min(rec.steps.len());
    let Some(s) = rec.steps[..n]
        .iter()
        .find(|s| s.flags & step::INNER_STATE == 0)
    else {
        return false;
    };
    let visit = rec.visits[usize::from(s.visit).min(rec.visits.len() - 1)];
    let has_ports = s.flags & (observer_common::flags::NO_L3 | observer_common::flags::NO_L4) == 0
        && matches!(s.l4proto, 6 | 17 | 132);
    let entry = FilterInput {
        saddr: s.saddr,
        daddr: s.daddr,
        ifindex_in: visit.ifindex_in,
        ifindex_out: visit.ifindex_out,
        mark: s.mark,
        sport: s.sport,
        dport: s.dport,
        ip_version: s.ip_version,
        l4proto: s.l4proto,
        has_ports: u8::from(has_ports),
        _pad: 0,
        _pad2: 0,
    };
    let mut inputs = [entry; MAX_INPUTS];
    let with_ct = rec.steps[..n]
        .iter()
        .any(|s| s.flags & observer_common::flags::CT != 0);
    if with_ct {
        let v4 = s.ip_version == 4;
        for (input, raw) in inputs[1..].iter_mut().zip([&rec.ct_orig, &rec.ct_reply]) {
            let t = raw_tuple(raw, layout, v4);
            let bytes = |a: std::net::IpAddr| match a {
                std::net::IpAddr::V4(a) => {
                    let mut b = [0u8; 16];
                    b[..4].copy_from_slice(&a.octets());
                    b
                }
                std::net::IpAddr::V6(a) => a.octets(),
            };
            input.saddr = bytes(t.src.addr);
            input.daddr = bytes(t.dst.addr);
            input.sport = t.src.port;
            input.dport = t.dst.port;
        }
    }
    let hashed = if with_ct { &inputs[1] } else { &inputs[0] };
    eval_any(prog, &inputs, if with_ct { 3 } else { 1 }) && sample_keep(prog, flow_hash(hashed))
}
