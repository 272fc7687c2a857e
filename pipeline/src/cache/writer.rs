//! Filling the cache: claiming a record (in this process, then in the file), writing it and
//! publishing it.

use std::sync::atomic::{fence, Ordering};

use crate::BadFileKind;

#[cfg(test)]
use super::faults;
use super::format::{bad_tag, record_sum};
use super::Cache;

impl Cache {
    /// Claims record `i` for writing in this process, before it is decoded; `None` if it is
    /// resolved, claimed by another worker, or not writable. The file's claim, which keeps
    /// other processes off the record, is taken when the record is written.
    pub(crate) fn claim(&self, i: usize) -> Option<RecordWriter<'_>> {
        if !self.writable() || i >= self.layout.count {
            return None;
        }
        let bit = 1u64 << (i % 64);
        let resolved = (self
            .word(self.layout.filled, i / 64)
            .load(Ordering::Acquire)
            | self.word(self.layout.bad, i / 64).load(Ordering::Acquire))
            & bit
            != 0;
        if resolved || self.in_flight[i / 64].fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return None;
        }
        self.begin_writes();
        Some(RecordWriter {
            cache: self,
            index: i,
            claimed: false,
            published: false,
        })
    }

    /// Takes record `i`'s bit in the file's claims bitmap with one atomic `fetch_or` on the
    /// mapped word: `true` for the one process (of all those mapping the file) that set it,
    /// when the record is not resolved yet. A claim stays set once its record is published
    /// (a published record is never written again unless it is found damaged).
    pub(super) fn claim_in_file(&self, i: usize) -> bool {
        let bit = 1u64 << (i % 64);
        if self
            .word(self.layout.claims, i / 64)
            .fetch_or(bit, Ordering::AcqRel)
            & bit
            != 0
        {
            return false;
        }
        // Resolved with its claim clear (a damage report that cleared the bit and claim of a
        // record just rewritten): the claim stays set, as for any resolved record.
        self.resolved_word(i / 64) & bit == 0
    }
}

/// Exclusive write access to one record, published on [`RecordWriter::write_and_commit`].
pub(crate) struct RecordWriter<'a> {
    cache: &'a Cache,
    index: usize,
    /// Whether this writer holds the record's bit in the file's claims bitmap.
    claimed: bool,
    published: bool,
}

impl RecordWriter<'_> {
    /// Writes the whole record with one positioned write, then the content hash of its
    /// source file (`source`) and its check, then publishes it.
    /// Writing through the file rather than the shared map spares a page fault per page of a
    /// fresh record (about 8 % of a first epoch) and turns a full disk into an error value;
    /// the kernel keeps the map coherent with the file's page cache, so readers see the bytes
    /// through the map once the bit is published. On an error nothing is published and the
    /// claim is released (a later pass decodes the image again). When another process holds
    /// the record's claim in the file (it decoded the same image), nothing is written: its
    /// record is served once published, and verified as any other process's.
    pub(crate) fn write_and_commit(mut self, pixels: &[u8], source: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let bytes = self.cache.layout.record_bytes;
        if pixels.len() != bytes {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("record of {} bytes, expected {bytes}", pixels.len()),
            ));
        }
        #[cfg(test)]
        faults::check(&self.cache.path)?;
        let file = self.cache.file.as_ref().ok_or_else(|| {
            std::io::Error::other("a disabled cache has no file (programmer error)")
        })?;
        if !self.cache.claim_in_file(self.index) {
            return Ok(());
        }
        self.claimed = true;
        let at = self.cache.layout.records + self.index * bytes;
        file.write_all_at(pixels, at as u64)?;
        let i = self.index;
        self.cache.source_word(i).store(source, Ordering::Relaxed);
        self.cache
            .check_word(i)
            .store(record_sum(pixels, i, source), Ordering::Relaxed);
        self.cache.verified[i / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
        self.commit();
        Ok(())
    }

    /// Publishes the record: every byte written so far becomes visible before the bit.
    fn commit(mut self) {
        fence(Ordering::Release);
        self.cache.publish(self.cache.layout.filled, self.index);
        self.published = true;
    }

    /// Marks the sample as a bad file of `kind`, so later epochs skip it without reading it.
    /// Only verdicts on the file's contents are kept: a file that could not be opened or
    /// read ([`BadFileKind::Unreadable`]) may be fine on the next run without any change to
    /// its size or times, so that kind only releases the claim.
    pub(crate) fn mark_bad(mut self, kind: BadFileKind) {
        if kind == BadFileKind::Unreadable || !self.cache.claim_in_file(self.index) {
            return;
        }
        self.claimed = true;
        self.cache
            .check_word(self.index)
            .store(bad_tag(self.index, kind), Ordering::Relaxed);
        self.cache.publish(self.cache.layout.bad, self.index);
        self.published = true;
    }
}

impl Drop for RecordWriter<'_> {
    /// An abandoned claim (error, panic, another process's claim) is released so a later
    /// epoch can fill the record; the file's claim first, so another process can. A
    /// published one stays claimed: the record must never be written again.
    fn drop(&mut self) {
        if !self.published {
            let (w, bit) = (self.index / 64, 1u64 << (self.index % 64));
            if self.claimed {
                self.cache
                    .word(self.cache.layout.claims, w)
                    .fetch_and(!bit, Ordering::AcqRel);
            }
            self.cache.in_flight[w].fetch_and(!bit, Ordering::AcqRel);
        }
    }
}
