//! Normal form: negations pushed down to the primitives, disjunctive normal form, and the
//! simplification that keeps only what matters before the program's limits are checked.

use observer_common::filter::Atom;

use super::parser::Expr;

/// Alternatives the DNF of `e` (negated if `neg`) has before simplification, saturating.
pub(super) fn count_terms(e: &Expr, neg: bool) -> u64 {
    match e {
        Expr::Prim(_) => 1,
        Expr::Not(x) => count_terms(x, !neg),
        Expr::And(a, b) | Expr::Or(a, b) => {
            let (x, y) = (count_terms(a, neg), count_terms(b, neg));
            // De Morgan: a negated `and` expands like an `or`.
            if matches!(e, Expr::And(..)) != neg {
                x.saturating_mul(y)
            } else {
                x.saturating_add(y)
            }
        }
    }
}

/// `e` (negated if `neg`) as alternatives of conjunctions of (possibly negated) atoms.
pub(super) fn to_dnf(e: &Expr, neg: bool) -> Vec<Vec<Atom>> {
    match e {
        Expr::Prim(p) => vec![vec![p.atom(neg)]],
        Expr::Not(x) => to_dnf(x, !neg),
        Expr::And(a, b) | Expr::Or(a, b) => {
            let (x, y) = (to_dnf(a, neg), to_dnf(b, neg));
            if matches!(e, Expr::And(..)) != neg {
                let mut out = Vec::with_capacity(x.len() * y.len());
                for l in &x {
                    for r in &y {
                        out.push(l.iter().chain(r).copied().collect());
                    }
                }
                out
            } else {
                let mut out = x;
                out.extend(y);
                out
            }
        }
    }
}

/// Drops repeated atoms, contradictory terms (`x and not x`) and terms implied by others
/// (`a or (a and b)` is `a`), so that what reaches the limits is what really matters.
pub(super) fn simplify(terms: Vec<Vec<Atom>>) -> Vec<Vec<Atom>> {
    let mut cleaned: Vec<Vec<Atom>> = Vec::with_capacity(terms.len());
    for t in terms {
        let mut atoms: Vec<Atom> = Vec::with_capacity(t.len());
        for a in t {
            if !atoms.contains(&a) {
                atoms.push(a);
            }
        }
        let contradictory = atoms.iter().any(|a| {
            let mut flipped = *a;
            flipped.negate ^= 1;
            atoms.contains(&flipped)
        });
        if !contradictory {
            cleaned.push(atoms);
        }
    }
    let subset = |small: &Vec<Atom>, big: &Vec<Atom>| small.iter().all(|a| big.contains(a));
    let mut kept: Vec<Vec<Atom>> = Vec::with_capacity(cleaned.len());
    for (i, t) in cleaned.iter().enumerate() {
        // Implied by a term that is kept already, or by a strictly smaller later one.
        let implied = kept.iter().any(|k| subset(k, t))
            || cleaned[i + 1..]
                .iter()
                .any(|o| o.len() < t.len() && subset(o, t));
        if !implied {
            kept.push(t.clone());
        }
    }
    kept
}
