//! A child's stdout, read as it comes and kept, so that a test can wait for a line.

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Stdout read so far by a reader thread; a pipe nobody reads fills up and stalls the
/// child, as it would a user's pipeline.
pub struct Printed {
    seen: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl Printed {
    pub fn read(mut from: impl Read + Send + 'static) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let shared = seen.clone();
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            loop {
                match from.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => shared.lock().unwrap().extend_from_slice(&chunk[..n]),
                }
            }
        });
        Self {
            seen,
            reader: Some(reader),
        }
    }

    /// Waits (within `within`) until `n` whole lines satisfy `pred`; panics naming `what`
    /// otherwise. Lets a test send its next packet once the one before it is reported,
    /// rather than after a guessed sleep.
    pub fn wait_for(&self, what: &str, within: Duration, n: usize, pred: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + within;
        loop {
            {
                let b = self.seen.lock().unwrap();
                let text = String::from_utf8_lossy(&b);
                // Only lines ended by a newline are whole.
                let whole = text.rfind('\n').map_or("", |i| &text[..i]);
                if whole.lines().filter(|l| pred(l)).count() >= n {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not printed within {within:?}; printed so far:\n{}",
                String::from_utf8_lossy(&self.seen.lock().unwrap())
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Everything printed, once the stream has ended (the child exited).
    pub fn finish(mut self) -> Vec<u8> {
        if let Some(r) = self.reader.take() {
            r.join().expect("stdout reader");
        }
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}
