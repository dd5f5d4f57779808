//! Tokens of a `--filter` expression: words, parentheses and the `and`/`or`/`not` operators
//! (and their `&&`/`||`/`!` spellings), each with its byte position for errors.

use super::FilterError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    LParen,
    RParen,
    Not,
    And,
    Or,
    Word,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Token<'a> {
    pub(super) kind: Kind,
    pub(super) pos: usize,
    pub(super) text: &'a str,
}

pub(super) fn tokenize(expr: &str) -> Result<Vec<Token<'_>>, FilterError> {
    let mut toks = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let two = expr.get(i..i + 2);
        let (kind, len) = match c {
            _ if c.is_ascii_whitespace() => {
                i += 1;
                continue;
            }
            b'(' => (Kind::LParen, 1),
            b')' => (Kind::RParen, 1),
            b'!' => (Kind::Not, 1),
            b'&' if two == Some("&&") => (Kind::And, 2),
            b'|' if two == Some("||") => (Kind::Or, 2),
            b'&' | b'|' => {
                let msg = if c == b'&' {
                    "expected `&&` or `and` (bitwise operators are not supported)"
                } else {
                    "expected `||` or `or` (bitwise operators are not supported)"
                };
                return Err(FilterError::new(expr, i, 1, msg));
            }
            _ => {
                let len = expr[i..]
                    .find(|ch: char| ch.is_ascii_whitespace() || "()!&|".contains(ch))
                    .unwrap_or(expr.len() - i);
                let word = &expr[i..i + len];
                let kind = match word {
                    "and" => Kind::And,
                    "or" => Kind::Or,
                    "not" => Kind::Not,
                    _ => Kind::Word,
                };
                (kind, len)
            }
        };
        toks.push(Token {
            kind,
            pos: i,
            text: &expr[i..i + len],
        });
        i += len;
    }
    Ok(toks)
}
