//! Language-modelling data: a plain-text corpus (the vendored Shakespeare,
//! `data/shakespeare/shakespeare.txt.gz`), its character vocabulary, a held-out split, and
//! datasets of token ids with next-token labels ([`TokenDataset`]), of a corpus's characters
//! ([`CharDataset`]) or of a tokenizer's ids (GPT-2 fine-tuning).
//!
//! Two kinds of items:
//! - fixed-length windows (nanoGPT's): `context + 1` consecutive characters, ids the first
//!   `context`, labels the last `context`; windows start every `context` characters, so one
//!   epoch reads the text once;
//! - variable-length lines: each line of at least two characters (cut to `context + 1`), padded
//!   to the batch's longest, padding labelled [`IGNORE_INDEX`]: micro-batches then carry
//!   different numbers of tokens, which token-weighted normalisation counts.

use std::io::Read;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use cellgraph_compiler::HostTensor;

use super::Sampling;
use crate::error::{Result, RuntimeError};

/// The label of padding, which the loss skips (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// A text and its characters.
#[derive(Clone, Debug)]
pub struct Corpus {
    pub text: Vec<u8>,
    /// The distinct bytes of the text, sorted: token `i` is `vocab[i]`.
    pub vocab: Vec<u8>,
    ids: [i32; 256],
}

fn data_err(path: &Path, offset: u64, detail: String) -> RuntimeError {
    RuntimeError::Data { path: path.display().to_string(), offset, detail }
}

/// A file's bytes, decompressed when it is gzip (its magic bytes), else as they are.
pub fn read_gzip_or_plain(path: &Path) -> Result<Vec<u8>> {
    if path.is_dir() {
        return Err(RuntimeError::Invalid { what: path.display().to_string(), detail: not_a_text_file(path) });
    }
    let raw = std::fs::read(path).map_err(|source| RuntimeError::Io { path: path.display().to_string(), source })?;
    if !raw.starts_with(&[0x1f, 0x8b]) {
        return Ok(raw);
    }
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(&raw[..])
        .read_to_end(&mut out)
        .map_err(|e| data_err(path, 0, format!("corrupt gzip stream ({e}); copy the file again")))?;
    Ok(out)
}

/// What to say of a directory given where a text file was expected: the text files in it
/// (`.txt`, `.txt.gz`, `.gz`), named, or that it holds none.
fn not_a_text_file(dir: &Path) -> String {
    let mut texts: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && [".txt", ".gz"].iter().any(|x| p.to_string_lossy().ends_with(x)))
        .map(|p| p.display().to_string())
        .collect();
    texts.sort();
    match &texts[..] {
        [] => "is a directory, with no .txt or .gz file in it: give the path of a text file or its gzip".into(),
        [one] => format!("is a directory: give the text file itself ({one})"),
        many => format!("is a directory: give one of its text files ({})", many.join(", ")),
    }
}

impl Corpus {
    /// Reads a text file, gzip-compressed or plain.
    pub fn load(path: &Path) -> Result<Corpus> {
        Corpus::parse(path, read_gzip_or_plain(path)?)
    }

    /// A corpus from text bytes (`path` names it in errors): printable ASCII, tabs and
    /// newlines; anything else is an error at its offset.
    pub fn parse(path: &Path, text: Vec<u8>) -> Result<Corpus> {
        if let Some(i) = text.iter().position(|&b| !(b == b'\n' || b == b'\t' || b == b'\r' || (32..127).contains(&b))) {
            return Err(data_err(
                path,
                i as u64,
                format!("byte {:#04x} is not printable ASCII: the character model reads plain ASCII text", text[i]),
            ));
        }
        if text.len() < 2 {
            return Err(data_err(path, 0, format!("{} bytes: a language model needs at least two characters", text.len())));
        }
        let mut seen = [false; 256];
        for &b in &text {
            seen[b as usize] = true;
        }
        let vocab: Vec<u8> = (0..=255u8).filter(|&b| seen[b as usize]).collect();
        let mut ids = [-1; 256];
        for (i, &b) in vocab.iter().enumerate() {
            ids[b as usize] = i as i32;
        }
        Ok(Corpus { text, vocab, ids })
    }

    /// Characters in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The token id of each byte of `s`; a byte the corpus never has is an error naming it.
    pub fn encode(&self, s: &[u8]) -> Result<Vec<i32>> {
        s.iter()
            .enumerate()
            .map(|(i, &b)| match self.ids[b as usize] {
                -1 => Err(RuntimeError::Invalid {
                    what: format!("character {:?} at position {i}", b as char),
                    detail: "is not in the corpus's vocabulary".into(),
                }),
                id => Ok(id),
            })
            .collect()
    }

    /// The text of token ids (ids outside the vocabulary print as `?`).
    pub fn decode(&self, ids: &[i32]) -> String {
        ids.iter().map(|&i| self.vocab.get(i as usize).map_or('?', |&b| b as char)).collect()
    }

    /// The training part and the held-out part: the held-out part is the last `fraction` of
    /// the text, starting at the paragraph break (a blank line) at or after that point (in
    /// the vendored corpus, the last works: from the end of *Troilus and Cressida* on).
    pub fn split(&self, fraction: f64) -> (Range<usize>, Range<usize>) {
        let n = self.text.len();
        let at = ((n as f64) * (1.0 - fraction.clamp(0.0, 1.0))) as usize;
        let cut = self.text[at.min(n)..].windows(2).position(|w| w == b"\n\n").map_or(n, |p| at + p + 2);
        (0..cut, cut..n)
    }
}

/// What an item of a [`CharDataset`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Items {
    /// Windows of `context + 1` characters, one every `context`.
    Windows,
    /// Lines of at least two characters, cut to `context + 1`, padded per batch.
    Lines,
}

/// Token ids `[n, T]` and next-token labels `[n, T]` (both i32) from a sequence of token ids:
/// a character corpus's ([`CharDataset`], [`TokenDataset::new`]) or a tokenizer's
/// ([`TokenDataset::windows`], [`TokenDataset::lines`]).
#[derive(Clone, Debug)]
pub struct TokenDataset {
    /// The token ids the items read.
    tokens: Arc<[i32]>,
    /// `(start, length)` of each item in `tokens`, ids and labels together.
    items: Vec<(usize, usize)>,
    kind: Items,
    context: usize,
    part: String,
    /// What a token is, in messages (`characters`, `tokens`).
    unit: &'static str,
    sampling: Sampling,
    /// At most this many batches per epoch.
    limit: Option<usize>,
    /// Lines' batches are padded to a multiple of this many tokens (1: to their longest).
    pad_multiple: usize,
}

/// A character corpus's dataset: the [`TokenDataset`] of its characters' ids.
pub type CharDataset = TokenDataset;

fn check_context(context: usize) -> Result<()> {
    if context == 0 {
        return Err(RuntimeError::Invalid { what: "context".into(), detail: "must be at least 1 token".into() });
    }
    Ok(())
}

/// Windows of `context + 1` tokens of a sequence of `len`, one every `context`.
fn windows_of(len: usize, context: usize) -> Vec<(usize, usize)> {
    (0..len.saturating_sub(context + 1) / context + usize::from(len > context)).map(|i| (i * context, context + 1)).collect()
}

impl TokenDataset {
    /// The items of `kind` in `range` of a character corpus, for a model of `context`
    /// positions; `part` names them in messages (`Shakespeare train`).
    pub fn new(corpus: Arc<Corpus>, range: Range<usize>, kind: Items, context: usize, part: &str) -> Result<Self> {
        check_context(context)?;
        let text = &corpus.text[range.clone()];
        let tokens: Arc<[i32]> = text.iter().map(|&b| corpus.ids[b as usize]).collect();
        let items: Vec<(usize, usize)> = match kind {
            Items::Windows => windows_of(text.len(), context),
            Items::Lines => {
                let mut v = Vec::new();
                let mut start = 0;
                for line in text.split_inclusive(|&b| b == b'\n') {
                    if line.len() >= 3 {
                        // The line with its newline: the model learns to end lines.
                        v.push((start, line.len().min(context + 1)));
                    }
                    start += line.len();
                }
                v
            }
        };
        Ok(TokenDataset {
            tokens,
            items,
            kind,
            context,
            part: part.into(),
            unit: "characters",
            sampling: Sampling::default(),
            limit: None,
            pad_multiple: 1,
        })
    }
    /// Windows of `context + 1` consecutive tokens of `tokens` (a tokenized text), one every
    /// `context`: GPT-2 fine-tuning's blocks.
    pub fn windows(tokens: Vec<i32>, context: usize, part: &str) -> Result<Self> {
        check_context(context)?;
        let items = windows_of(tokens.len(), context);
        Ok(TokenDataset {
            tokens: tokens.into(),
            items,
            kind: Items::Windows,
            context,
            part: part.into(),
            unit: "tokens",
            sampling: Sampling::default(),
            limit: None,
            pad_multiple: 1,
        })
    }
    /// One item per line of at least two tokens (each line tokenized on its own), cut to
    /// `context + 1` and padded per batch, padding labelled [`IGNORE_INDEX`].
    pub fn lines(lines: Vec<Vec<i32>>, context: usize, part: &str) -> Result<Self> {
        check_context(context)?;
        let (mut tokens, mut items) = (Vec::new(), Vec::new());
        for line in lines.into_iter().filter(|l| l.len() >= 2) {
            items.push((tokens.len(), line.len().min(context + 1)));
            tokens.extend(line);
        }
        Ok(TokenDataset {
            tokens: tokens.into(),
            items,
            kind: Items::Lines,
            context,
            part: part.into(),
            unit: "tokens",
            sampling: Sampling::default(),
            limit: None,
            pad_multiple: 1,
        })
    }
    super::dataset::sampling_builders!();
    /// Ends each epoch after `n` batches (the first of its shuffled order): a corpus too long
    /// to read whole between two validations.
    pub fn take_batches(mut self, n: usize) -> Self {
        self.limit = Some(n);
        self
    }
    /// Pads each batch of lines to a multiple of `m` tokens (at most the context), as
    /// `transformers`' `DataCollatorWithPadding(pad_to_multiple_of=m)`: fewer batch shapes (a
    /// device compiles, and with graphs captures, one plan per shape), the same loss and
    /// gradients (padding is labelled [`IGNORE_INDEX`] and attention is causal).
    pub fn pad_to_multiple_of(mut self, m: usize) -> Self {
        self.pad_multiple = m.max(1);
        self
    }
    /// Items in the part.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// True without an item.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    /// An error unless an epoch has a batch.
    pub fn check_batches(&self) -> Result<()> {
        self.sampling.check_batches(self.items.len(), || self.describe_items())
    }
    fn describe_items(&self) -> String {
        let kind = match self.kind {
            Items::Windows => format!("windows of {} {}", self.context + 1, self.unit),
            Items::Lines => format!("lines of up to {} {}", self.context + 1, self.unit),
        };
        format!("{} ({kind})", self.part)
    }
    /// The batch of items `idx`: ids and labels `[n, T]`, `T` the context (windows) or the
    /// longest item's length minus one, rounded up to the padding multiple within the context
    /// (lines, padding labelled [`IGNORE_INDEX`]), and the
    /// items' indices (`i64 [n]`: dropout's keys, the same on every rank and micro-batch).
    pub fn batch_of(&self, idx: &[usize]) -> [HostTensor; 3] {
        let t = match self.kind {
            Items::Windows => self.context,
            Items::Lines => {
                let longest = idx.iter().map(|&i| self.items[i].1 - 1).max().unwrap_or(1);
                longest.next_multiple_of(self.pad_multiple).min(self.context.max(longest))
            }
        };
        let mut ids = vec![0i32; idx.len() * t];
        let mut labels = vec![IGNORE_INDEX; idx.len() * t];
        for (k, &i) in idx.iter().enumerate() {
            let (start, len) = self.items[i];
            let item = &self.tokens[start..start + len];
            ids[k * t..k * t + len - 1].copy_from_slice(&item[..len - 1]);
            labels[k * t..k * t + len - 1].copy_from_slice(&item[1..]);
        }
        let n = idx.len();
        [
            HostTensor::i32(vec![n, t], ids).expect("consistent sizes"),
            HostTensor::i32(vec![n, t], labels).expect("consistent sizes"),
            HostTensor::new(vec![n], cellgraph_compiler::HostData::I64(idx.iter().map(|&i| i as i64).collect())).expect("consistent sizes"),
        ]
    }
}

impl super::Dataset for TokenDataset {
    fn dataset_size(&self) -> usize {
        let n = self.sampling.dataset_size(self.items.len());
        self.limit.map_or(n, |l| l.min(n))
    }
    fn batches(&self, epoch: usize, skip: usize) -> Box<dyn Iterator<Item = Vec<HostTensor>> + Send + '_> {
        let order = self.sampling.order(self.items.len(), epoch);
        let b = self.sampling.batch_size();
        Box::new((skip..self.dataset_size()).map(move |k| self.batch_of(&order[k * b..((k + 1) * b).min(order.len())]).to_vec()))
    }
    fn column_names(&self) -> Vec<&'static str> {
        vec!["ids", "labels", cellgraph_cells::cell::ITEM_INDEX]
    }
    fn batch_sizes(&self) -> Vec<usize> {
        let mut v = self.sampling.batch_lengths(self.items.len());
        v.truncate(self.dataset_size());
        v
    }
    fn batch_size(&self) -> usize {
        self.sampling.batch_size()
    }
    fn describe(&self) -> String {
        let limit = self
            .limit
            .filter(|&l| l < self.sampling.dataset_size(self.items.len()))
            .map_or(String::new(), |l| format!(", the first {l} batches of each epoch"));
        format!("{}{limit}", self.sampling.describe(&self.describe_items(), self.items.len()))
    }
}
