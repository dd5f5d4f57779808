//! Standard output, written by a thread of its own so that a slow reader never stalls the
//! collector: reports are formatted into chunks handed over through a bounded channel. When
//! the reader falls behind and the channel is full, the collector stops draining the ring
//! buffer (the probes then count what they cannot write as lost) but keeps answering signals
//! and timers. Memory is bounded by the channel: at most [`CHUNKS`] chunks of about
//! [`CHUNK_BYTES`].

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

/// Chunks the writer thread may hold before the collector waits.
pub const CHUNKS: usize = 8;
/// A chunk is handed over once it holds this much.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// Formatted reports and how many traversals they hold.
type Chunk = (Vec<u8>, u64);

pub struct Writer {
    tx: Option<SyncSender<Chunk>>,
    /// The chunk being filled.
    buf: Vec<u8>,
    buf_count: u64,
    /// A chunk the channel had no room for.
    waiting: Option<Chunk>,
    /// Traversals handed to the thread, and those it has written.
    handed: u64,
    written: Arc<AtomicU64>,
    closed: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Starts the writer thread on `out` (stdout, or anything for tests).
    pub fn new<W: Write + Send + 'static>(mut out: W) -> Self {
        let (tx, rx) = sync_channel::<Chunk>(CHUNKS);
        let written = Arc::new(AtomicU64::new(0));
        let closed = Arc::new(AtomicBool::new(false));
        let thread = {
            let (written, closed) = (written.clone(), closed.clone());
            std::thread::spawn(move || {
                for (chunk, n) in rx {
                    if out.write_all(&chunk).and_then(|()| out.flush()).is_err() {
                        // A closed pipe (`| head`): nothing more can be shown.
                        closed.store(true, Ordering::Relaxed);
                        return;
                    }
                    written.fetch_add(n, Ordering::Relaxed);
                }
            })
        };
        Self {
            tx: Some(tx),
            buf: Vec::with_capacity(CHUNK_BYTES + 16 * 1024),
            buf_count: 0,
            waiting: None,
            handed: 0,
            written,
            closed,
            thread: Some(thread),
        }
    }

    /// Where the next report is formatted; call [`Writer::done`] after each one.
    pub fn buf(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// One report was formatted into [`Writer::buf`].
    pub fn done(&mut self) {
        self.buf_count += 1;
        if self.buf.len() >= CHUNK_BYTES {
            self.push();
        }
    }

    /// Hands what is formatted to the thread. Returns false while the thread has no room
    /// (the caller then stops producing until a later call succeeds).
    pub fn push(&mut self) -> bool {
        let Some(tx) = &self.tx else {
            return false;
        };
        if let Some(chunk) = self.waiting.take() {
            match tx.try_send(chunk) {
                Ok(()) => {}
                Err(TrySendError::Full(c) | TrySendError::Disconnected(c)) => {
                    self.waiting = Some(c);
                    return false;
                }
            }
        }
        if self.buf_count == 0 {
            return true;
        }
        let chunk = (
            std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK_BYTES + 16 * 1024)),
            std::mem::take(&mut self.buf_count),
        );
        self.handed += chunk.1;
        match tx.try_send(chunk) {
            Ok(()) => true,
            Err(TrySendError::Full(c) | TrySendError::Disconnected(c)) => {
                self.waiting = Some(c);
                false
            }
        }
    }

    /// Whether the writer is behind: nothing more should be formatted until `push` succeeds.
    pub fn behind(&self) -> bool {
        self.waiting.is_some()
    }

    /// stdout was closed.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }

    /// Hands over the rest and waits up to `limit` for it to be written. Returns
    /// (written, not written) in traversals; what is still unwritten then is abandoned (the
    /// process is about to exit).
    pub fn finish(mut self, limit: Duration) -> (u64, u64) {
        let deadline = Instant::now() + limit;
        while !self.push() && Instant::now() < deadline && !self.closed() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let unsent = self.waiting.as_ref().map_or(0, |c| c.1) + self.buf_count;
        // The handed count includes a waiting chunk; it is counted once, as unsent.
        let handed = self.handed - self.waiting.as_ref().map_or(0, |c| c.1);
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            while !t.is_finished() && Instant::now() < deadline && !self.closed() {
                std::thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
        let written = self.written.load(Ordering::Relaxed);
        (written, handed - written + unsent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that blocks until told to go on, then records everything.
    struct Gate {
        open: Arc<AtomicBool>,
        seen: Arc<std::sync::Mutex<Vec<u8>>>,
    }

    impl Write for Gate {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            while !self.open.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.seen.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_stalled_reader_makes_the_writer_say_it_is_behind_without_blocking() {
        let open = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut w = Writer::new(Gate {
            open: open.clone(),
            seen: seen.clone(),
        });
        let t0 = Instant::now();
        let mut produced = 0u64;
        // Far more than the channel holds; every call returns at once.
        while !w.behind() {
            w.buf().extend_from_slice(&[b'x'; 4096]);
            w.buf().push(b'\n');
            w.done();
            produced += 1;
            assert!(produced < 10_000, "the writer never fell behind");
        }
        assert!(t0.elapsed() < Duration::from_secs(2));
        open.store(true, Ordering::Relaxed);
        let (written, lost) = w.finish(Duration::from_secs(5));
        assert_eq!((written, lost), (produced, 0));
        assert_eq!(seen.lock().unwrap().len() as u64, produced * 4097);
    }

    #[test]
    fn a_closed_reader_is_reported_and_counted() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut w = Writer::new(Closed);
        w.buf().extend_from_slice(b"line\n");
        w.done();
        assert!(w.push());
        let t0 = Instant::now();
        while !w.closed() {
            assert!(t0.elapsed() < Duration::from_secs(2));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(w.finish(Duration::from_millis(100)), (0, 1));
    }
}
