//! `--filter` expressions: a subset of pcap-filter syntax (plus observer's `iface` and `mark`)
//! compiled into the [`FilterProgram`] the probes evaluate (`observer_common::filter`).
//!
//! Text -> tokens -> AST (recursive descent, pcap precedence) -> negations pushed down to the
//! primitives -> disjunctive normal form -> fixed-size wire program. Every error carries the
//! byte span of the token it is about; `docs/filter.md` describes the language.
//!
//! Pure code: [`lexer`] -> [`parser`] (and its AST) -> [`normal`] (negations pushed down,
//! DNF, simplified) -> the wire program; [`eval`] decides a recorded traversal on the host as
//! the probes decide it live. The kernel side only loads what this compiled.

pub mod eval;
mod lexer;
mod normal;
mod parser;
#[cfg(test)]
mod tests;

use observer_common::filter::{FilterProgram, MAX_ATOMS, MAX_TERMS, Term};
use thiserror::Error;

use normal::{count_terms, simplify, to_dnf};
use parser::parse;

/// A filter that cannot be compiled, with the span of the offending token.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("bad filter: {message}\n{}", self.snippet())]
pub struct FilterError {
    /// What is wrong and what was expected.
    pub message: String,
    /// The whole expression.
    pub expr: String,
    /// Byte offset of the offending token in `expr` (`expr.len()` for "at the end").
    pub pos: usize,
    /// Byte length of the offending token (0 at the end).
    pub len: usize,
}

impl FilterError {
    fn new(expr: &str, pos: usize, len: usize, message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            expr: expr.to_string(),
            pos,
            len,
        }
    }

    /// The expression and a caret line under the offending token, both indented by two.
    fn snippet(&self) -> String {
        // Columns count characters, and control characters print as one space each, so the
        // carets line up under any UTF-8 input.
        let shown: String = self
            .expr
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let pos = self.pos.min(self.expr.len());
        let end = (pos + self.len).min(self.expr.len());
        let col = self.expr.get(..pos).map_or(0, |s| s.chars().count());
        let width = self
            .expr
            .get(pos..end)
            .map_or(0, |s| s.chars().count())
            .max(1);
        format!("  {shown}\n  {}{}", " ".repeat(col), "^".repeat(width))
    }
}

/// Compiles `expr` into a program for the probes. `ifindex` resolves `iface NAME` (in the
/// network namespace being traced). An empty expression keeps everything. The caller sets
/// [`FilterProgram::sample`] for `--sample`.
pub fn compile(
    expr: &str,
    ifindex: &dyn Fn(&str) -> Option<u32>,
) -> Result<FilterProgram, FilterError> {
    let Some(ast) = parse(expr, ifindex)? else {
        return Ok(FilterProgram::KEEP_ALL);
    };
    let too_complex = |n: String| {
        FilterError::new(
            expr,
            0,
            expr.len(),
            format!(
                "filter too complex: {n} alternatives after expansion, at most {MAX_TERMS} \
                 (every `or` inside an `and` multiplies them; factor the expression)"
            ),
        )
    };
    let raw = count_terms(&ast, false);
    if raw > EXPANSION_LIMIT {
        let n = if raw == u64::MAX {
            "more than 2^64".to_string()
        } else {
            raw.to_string()
        };
        return Err(too_complex(n));
    }
    let terms = simplify(to_dnf(&ast, false));
    if terms.len() > MAX_TERMS {
        return Err(too_complex(terms.len().to_string()));
    }
    if let Some(big) = terms.iter().find(|t| t.len() > MAX_ATOMS) {
        return Err(FilterError::new(
            expr,
            0,
            expr.len(),
            format!(
                "filter too complex: an alternative needs {} conditions after expansion, at \
                 most {MAX_ATOMS}",
                big.len()
            ),
        ));
    }
    if terms.iter().any(Vec::is_empty) {
        return Ok(FilterProgram::KEEP_ALL);
    }
    let mut prog = FilterProgram::KEEP_ALL;
    prog.enabled = 1;
    prog.n_terms = terms.len() as u32;
    for (slot, atoms) in prog.terms.iter_mut().zip(&terms) {
        *slot = Term::EMPTY;
        slot.n_atoms = atoms.len() as u32;
        slot.atoms[..atoms.len()].copy_from_slice(atoms);
    }
    Ok(prog)
}

/// Above this many raw alternatives the expansion is not even attempted.
const EXPANSION_LIMIT: u64 = 4096;

/// Nesting (parentheses, `not`) plus the height of the tree below: the parser and every
/// pass over the tree recurse this deep at most, whatever the input (a filter nested
/// 30,000 deep would overflow the stack of the agent's request handler).
pub const MAX_DEPTH: usize = 100;
