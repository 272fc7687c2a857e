//! Filling the cache: claiming a record, writing it and publishing it.

use std::sync::atomic::{fence, Ordering};

use crate::BadFileKind;

#[cfg(test)]
use super::faults;
use super::format::{bad_tag, record_sum};
use super::Cache;

impl Cache {
    /// Claims record `i` for writing; `None` if it is resolved, claimed, or not writable.
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
        if resolved || self.claims[i / 64].fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return None;
        }
        self.begin_writes();
        Some(RecordWriter {
            cache: self,
            index: i,
            published: false,
        })
    }
}

/// Exclusive write access to one record, published on [`RecordWriter::write_and_commit`].
pub(crate) struct RecordWriter<'a> {
    cache: &'a Cache,
    index: usize,
    published: bool,
}

impl RecordWriter<'_> {
    /// Writes the whole record with one positioned write, then the content hash of its
    /// source file (`source`) and its check, then publishes it.
    /// Writing through the file rather than the shared map spares a page fault per page of a
    /// fresh record (about 8 % of a first epoch) and turns a full disk into an error value;
    /// the kernel keeps the map coherent with the file's page cache, so readers see the bytes
    /// through the map once the bit is published. On an error nothing is published and the
    /// claim is released (a later pass decodes the image again).
    pub(crate) fn write_and_commit(self, pixels: &[u8], source: u64) -> std::io::Result<()> {
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
        if kind == BadFileKind::Unreadable {
            return;
        }
        self.cache
            .check_word(self.index)
            .store(bad_tag(self.index, kind), Ordering::Relaxed);
        self.cache.publish(self.cache.layout.bad, self.index);
        self.published = true;
    }
}

impl Drop for RecordWriter<'_> {
    /// An abandoned claim (error, panic) is released so a later epoch can fill the record.
    /// A published one stays claimed: the record must never be written again.
    fn drop(&mut self) {
        if !self.published {
            let bit = 1u64 << (self.index % 64);
            self.cache.claims[self.index / 64].fetch_and(!bit, Ordering::AcqRel);
        }
    }
}
