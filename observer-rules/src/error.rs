//! Error types shared by the parsers: every malformed input is reported with the line and
//! column where reading stopped, so a user can find the offending text in a large dump.

use thiserror::Error;

/// A parse failure at a 1-based line and column of the input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("line {line}, column {column}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl ParseError {
    pub fn new(line: usize, column: usize, message: impl Into<String>) -> Self {
        Self {
            line,
            column,
            message: message.into(),
        }
    }
}
