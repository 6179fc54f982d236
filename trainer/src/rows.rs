//! [`RowSource`]: where a run's rows come from, one at a time (a real data set's features do not
//! fit in memory). The built-in rows are a `Vec` of [`TrainRow`]s; a real run's rows are
//! [`DataRows`]: the documents of a tokenized data set packed once into rows of `S` tokens (the
//! run's RNG shuffles the rows every epoch), with their features from one of [`RowFeatures`].

use std::collections::BTreeMap;

use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use dflash_data::features::FeatureCache;
use dflash_data::rows::{Packing, RowBuilder};
use dflash_data::Dataset;
use dflash_reference::data::{document_runs, Row, TrainRow};
use dflash_reference::target::Target;
use half::slice::HalfBitsSliceExt;
use sha2::{Digest, Sha256};

use crate::checkpoint::data_sha256;
use crate::error::{panic_message, Error, Result};

/// A row's features `[S, F*H]` (bf16) from the cache, for a row of `tokens` (`S`) holding each of
/// `docs` (its token range in the row, its document in the cache) in order from the row's start;
/// the padding after the last is zero. A document whose tokens differ from the row's is refused
/// (a cache of other data).
pub fn cached_features(cache: &FeatureCache, tokens: &[u32], docs: &[(Range<usize>, usize)]) -> Result<Tensor> {
    let (s, width) = (tokens.len(), cache.index.feature_width());
    let mut values: Vec<half::bf16> = Vec::with_capacity(s * width);
    for (run, d) in docs {
        let doc = cache.doc(*d).map_err(|e| Error::option("features", e.to_string()))?;
        if run.start * width != values.len() || tokens.get(run.clone()) != Some(&doc.tokens[..]) {
            return Err(Error::option(
                "features",
                format!(
                    "{}: document {d} holds other tokens than the data's (the cache was made from other data)",
                    cache.dir.display()
                ),
            ));
        }
        values.extend_from_slice(doc.features.reinterpret_cast());
    }
    values.resize(s * width, half::bf16::ZERO);
    Ok(Tensor::from_vec(values, (s, width), &Device::Cpu)?)
}

/// The rows of a run, by index (read from several threads: the run reads the next step's rows
/// while a step runs).
pub trait RowSource: Sync {
    /// Number of rows.
    fn len(&self) -> usize;
    /// Whether there is no row.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Row `i` with its features (`[S, 0]` when the engine computes them online).
    fn row(&self, i: usize) -> Result<TrainRow>;
    /// Row `i` without its features (`[S, 0]`): for anchors alone (another process's row).
    fn row_without_features(&self, i: usize) -> Result<TrainRow> {
        self.row(i)
    }
    /// A sha256 naming the rows (a checkpoint of other rows is refused on resume).
    fn sha256(&self) -> Result<String>;
}

/// A step's rows, by micro-batch.
pub type StepRows = Vec<Vec<TrainRow>>;

/// The rows of `ids` (micro-batches of row ids) from `data`: those at the positions `own` (in
/// the step's order) with their features, the others without ([`StepEngine::own_rows`]).
///
/// [`StepEngine::own_rows`]: crate::engine::StepEngine::own_rows
pub fn fetch_rows(data: &dyn RowSource, ids: &[Vec<usize>], own: &Range<usize>) -> Result<StepRows> {
    let mut at = 0..;
    ids.iter()
        .map(|m| {
            m.iter()
                .zip(at.by_ref())
                .map(|(&i, k)| match own.contains(&k) {
                    true => data.row(i),
                    false => data.row_without_features(i),
                })
                .collect()
        })
        .collect()
}

/// A step's rows read ahead, on a thread of a [`std::thread::scope`] while the step before runs
/// (a cached row's features read from the cache's files, a reference target's forward).
#[derive(Default)]
pub struct ReadAhead<'scope> {
    /// The ids being read (and the positions read with their features), and their reading.
    pending: Option<(Read, Reading<'scope>)>,
}

/// A step's row ids and the positions read with their features ([`fetch_rows`]).
type Read = (Vec<Vec<usize>>, Range<usize>);

type Reading<'scope> = std::thread::ScopedJoinHandle<'scope, Result<StepRows>>;

impl<'scope> ReadAhead<'scope> {
    /// The rows of `ids` ([`fetch_rows`] with `own`): those read ahead when they are these,
    /// else read now.
    pub fn rows(&mut self, data: &dyn RowSource, ids: &[Vec<usize>], own: &Range<usize>) -> Result<StepRows> {
        match self.pending.take() {
            Some(((ahead, ahead_own), reading)) if ahead == ids && &ahead_own == own => {
                reading.join().map_err(panicked)?
            }
            _ => fetch_rows(data, ids, own),
        }
    }

    /// Starts reading the rows of `ids` ([`fetch_rows`] with `own`) on a thread of `scope`.
    pub fn start<'env>(
        &mut self,
        scope: &'scope std::thread::Scope<'scope, 'env>,
        data: &'env dyn RowSource,
        ids: Vec<Vec<usize>>,
        own: Range<usize>,
    ) {
        let (read, read_own) = (ids.clone(), own.clone());
        self.pending = Some(((ids, own), scope.spawn(move || fetch_rows(data, &read, &read_own))));
    }
}

/// Joins a reading left pending (a run that stops with an error), so that a panic there does not
/// become the scope's panic in place of that error.
impl Drop for ReadAhead<'_> {
    fn drop(&mut self) {
        if let Some((_, reading)) = self.pending.take() {
            _ = reading.join();
        }
    }
}

/// The error of a reading thread that panicked, with its message.
fn panicked(payload: Box<dyn std::any::Any + Send>) -> Error {
    Error::option("data", format!("the thread reading rows ahead panicked: {}", panic_message(payload)))
}

impl RowSource for Vec<TrainRow> {
    fn len(&self) -> usize {
        <[TrainRow]>::len(self)
    }

    fn row(&self, i: usize) -> Result<TrainRow> {
        self.get(i).cloned().ok_or_else(|| Error::option("rows", format!("no row {i} of {}", self.len())))
    }

    fn sha256(&self) -> Result<String> {
        data_sha256(self)
    }
}

/// Where a real row's features come from.
pub enum RowFeatures<'a> {
    /// Computed by the engine's target forward (the row carries `[S, 0]`).
    Online,
    /// The offline cache (`xtask features`): each document's features, in `dtype`.
    Cache(&'a FeatureCache, DType),
    /// The reference target on the CPU (small targets; the reference engine).
    Reference(&'a dyn Target, Vec<usize>),
}

/// A data set's documents (`docs`, in this order) packed into rows of `seq_len` tokens, every
/// row padded to `seq_len` (one document per row when the data set does not pack).
pub struct DataRows<'a> {
    dataset: &'a Dataset,
    /// The documents of each row.
    rows: Vec<Vec<usize>>,
    seq_len: usize,
    pad_id: u32,
    features: RowFeatures<'a>,
    /// What the features are made from (target, layer ids, data: `features::provenance`).
    provenance: BTreeMap<String, String>,
}

impl<'a> DataRows<'a> {
    /// Packs `docs` (at most `max_rows` rows) whose features `features` gives, made from
    /// `provenance`; an error when no row is left.
    pub fn new(
        dataset: &'a Dataset,
        docs: &[usize],
        seq_len: usize,
        max_rows: usize,
        features: RowFeatures<'a>,
        provenance: BTreeMap<String, String>,
    ) -> Result<Self> {
        let pad_id = match dataset.packing {
            Packing::Packed { pad_id, .. } => pad_id,
            Packing::OnePerRow => 0,
        };
        let mut rows = Vec::new();
        let mut next = 0;
        for row in RowBuilder::new(docs.iter().map(|&i| dataset.cache.document(i)), dataset.packing) {
            if rows.len() == max_rows {
                break;
            }
            let row = row.map_err(|e| Error::option("data", e.to_string()))?;
            let n = row.doc_ids.iter().filter(|&&d| d >= 0).max().map_or(0, |&d| d as usize + 1);
            rows.push(docs[next..next + n].to_vec());
            next += n;
        }
        if rows.is_empty() {
            return Err(Error::option("data", "no rows"));
        }
        Ok(DataRows { dataset, rows, seq_len, pad_id, features, provenance })
    }

    /// Row `i` without features (tokens, mask, document ids, positions), padded to `S`.
    pub fn plain_row(&self, i: usize) -> Result<Row> {
        let docs = self.rows.get(i).ok_or_else(|| Error::option("rows", format!("no row {i} of {}", self.len())))?;
        let mut row = Row { tokens: vec![], loss_mask: vec![], doc_ids: vec![], positions: vec![] };
        for (id, &d) in docs.iter().enumerate() {
            let doc = self.dataset.cache.document(d).map_err(|e| Error::option("data", e.to_string()))?;
            row.positions.extend(0..doc.tokens.len());
            row.doc_ids.extend(std::iter::repeat_n(id as i64, doc.tokens.len()));
            row.tokens.extend(doc.tokens);
            row.loss_mask.extend(doc.loss_mask);
        }
        if row.tokens.len() > self.seq_len {
            return Err(Error::option(
                "data",
                format!("row {i}: {} tokens, above S = {}", row.tokens.len(), self.seq_len),
            ));
        }
        let pad = self.seq_len - row.tokens.len();
        row.tokens.extend(std::iter::repeat_n(self.pad_id, pad));
        row.loss_mask.extend(std::iter::repeat_n(false, pad));
        row.doc_ids.extend(std::iter::repeat_n(-1, pad));
        row.positions.extend(std::iter::repeat_n(0, pad));
        Ok(row)
    }

    /// `S`, the tokens of every row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
}

impl RowSource for DataRows<'_> {
    fn len(&self) -> usize {
        self.rows.len()
    }

    fn row_without_features(&self, i: usize) -> Result<TrainRow> {
        let row = self.plain_row(i)?;
        let features = Tensor::zeros((row.tokens.len(), 0), DType::F32, &Device::Cpu)?;
        Ok(TrainRow::from_row(row, features)?)
    }

    fn row(&self, i: usize) -> Result<TrainRow> {
        let row = self.plain_row(i)?;
        let s = row.tokens.len();
        let features = match &self.features {
            RowFeatures::Online => Tensor::zeros((s, 0), DType::F32, &Device::Cpu)?,
            RowFeatures::Reference(target, layer_ids) => target.row_features(&row, layer_ids)?,
            RowFeatures::Cache(cache, dtype) => {
                let docs: Vec<_> = document_runs(&row.doc_ids).into_iter().zip(self.rows[i].iter().copied()).collect();
                cached_features(cache, &row.tokens, &docs)?.to_dtype(*dtype)?
            }
        };
        Ok(TrainRow::from_row(row, features)?)
    }

    /// Over the data set's key, the documents of every row, `S`, the feature source and its
    /// provenance.
    fn sha256(&self) -> Result<String> {
        let mut h = Sha256::new();
        h.update(self.dataset.cache.key);
        for (k, v) in &self.provenance {
            h.update(k.as_bytes());
            h.update(v.as_bytes());
        }
        h.update((self.seq_len as u64).to_le_bytes());
        for docs in &self.rows {
            h.update((docs.len() as u64).to_le_bytes());
            docs.iter().for_each(|&d| h.update((d as u64).to_le_bytes()));
        }
        match &self.features {
            RowFeatures::Online => h.update(b"online"),
            RowFeatures::Cache(..) => h.update(b"cache"),
            RowFeatures::Reference(..) => h.update(b"reference"),
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_data::features::{Entry, FeatureIndex, FeatureWriter};
    use rand::{Rng, SeedableRng};

    /// Rows of random tokens that count how many were read with their features.
    struct Counting {
        rows: Vec<TrainRow>,
        with_features: std::sync::atomic::AtomicUsize,
    }

    impl RowSource for Counting {
        fn len(&self) -> usize {
            self.rows.len()
        }
        fn row(&self, i: usize) -> Result<TrainRow> {
            self.with_features.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(self.rows[i].clone())
        }
        fn row_without_features(&self, i: usize) -> Result<TrainRow> {
            let row = &self.rows[i];
            let none = Tensor::zeros((row.len(), 0), DType::F32, &Device::Cpu)?;
            Ok(TrainRow { features: none, ..row.clone() })
        }
        fn sha256(&self) -> Result<String> {
            Ok(String::new())
        }
    }

    /// A step's rows at the positions `own` (across micro-batches, in the step's order) come with
    /// their features, the others with their tokens and masks alone; read ahead the same.
    #[test]
    fn only_the_own_rows_are_read_with_their_features() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::rng().random());
        let rows: Vec<TrainRow> = (0..7)
            .map(|_| {
                let s = rng.random_range(4..12);
                let tokens = (0..s).map(|_| rng.random_range(0..100)).collect();
                let features = Tensor::rand(0f32, 1.0, (s, 3), &Device::Cpu).unwrap();
                TrainRow::single(tokens, vec![true; s], features).unwrap()
            })
            .collect();
        let data = Counting { rows, with_features: Default::default() };
        let ids = vec![vec![3, 0, 6], vec![2, 5, 1]];
        let start = rng.random_range(0..6);
        let own = start..rng.random_range(start..=6);
        let check = |got: &StepRows| {
            for (k, (row, &i)) in got.iter().flatten().zip(ids.iter().flatten()).enumerate() {
                assert_eq!(row.tokens, data.rows[i].tokens, "position {k}");
                let width = if own.contains(&k) { 3 } else { 0 };
                assert_eq!(row.features.dims(), &[row.len(), width], "position {k} of own {own:?}");
            }
        };
        check(&fetch_rows(&data, &ids, &own).unwrap());
        std::thread::scope(|scope| {
            let mut ahead = ReadAhead::default();
            ahead.start(scope, &data, ids.clone(), own.clone());
            check(&ahead.rows(&data, &ids, &own).unwrap());
        });
        let read = data.with_features.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(read, 2 * own.len(), "rows read with their features");
    }

    /// A row's features from the cache: each document's in its token range, zeros after the last;
    /// a document whose tokens are not the row's, or out of the row's order, is refused.
    #[test]
    fn cached_features_place_each_document_and_refuse_other_tokens() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::rng().random());
        let (h, layers) = (rng.random_range(2..9), vec![0, 2]);
        let width = h * layers.len();
        let lens: Vec<usize> = (0..3).map(|_| rng.random_range(1..20)).collect();
        let dir = tempfile::tempdir().unwrap();
        let index = FeatureIndex {
            format: String::new(),
            provenance: BTreeMap::new(),
            hidden_size: h,
            layer_ids: layers,
            shard_bytes: 64,
            documents: lens.len(),
            tokens: lens.iter().sum::<usize>() as u64,
            shards: vec![],
        };
        let mut writer = FeatureWriter::open(dir.path(), index).unwrap();
        let mut docs = Vec::new();
        for &n in &lens {
            let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..1000)).collect();
            let features: Vec<u16> =
                (0..n * width).map(|_| half::bf16::from_f32(rng.random_range(-4.0..4.0)).to_bits()).collect();
            writer.push(Entry { tokens: &tokens, loss_mask: &vec![true; n], features: &features }).unwrap();
            docs.push((tokens, features));
        }
        writer.finish().unwrap();
        let cache = FeatureCache::open(dir.path(), None).unwrap();

        // Documents 2 then 0 packed into a row of S tokens, padded.
        let (a, b) = (lens[2], lens[0]);
        let s = a + b + rng.random_range(0..5);
        let mut tokens = [docs[2].0.clone(), docs[0].0.clone()].concat();
        tokens.resize(s, 0);
        let got = cached_features(&cache, &tokens, &[(0..a, 2), (a..a + b, 0)]).unwrap();
        assert_eq!(got.dims(), [s, width]);
        let got: Vec<u16> =
            got.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap().iter().map(|v| v.to_bits()).collect();
        let mut want = [docs[2].1.clone(), docs[0].1.clone()].concat();
        want.resize(s * width, 0);
        assert_eq!(got, want);

        let mut other = tokens.clone();
        other[rng.random_range(0..a + b)] += 1;
        let err = cached_features(&cache, &other, &[(0..a, 2), (a..a + b, 0)]).unwrap_err().to_string();
        assert!(err.contains("holds other tokens than the data's"), "{err}");
        let err = cached_features(&cache, &tokens, &[(a..a + b, 0)]).unwrap_err().to_string();
        assert!(err.contains("document 0 holds other tokens"), "{err}");
    }
}
