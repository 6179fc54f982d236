//! `--plan`: the resolved config, the run's size and an estimate of its time, without training.

use dflash_reference::config::DraftConfig;

use crate::builtin::num_params;
use crate::config::RunConfig;

/// Sustained FLOP/s of the CPU engines on the tiny default, measured on the 2-core CI machine
/// (the default run's `training` and `data` phases divided into their FLOP counts below).
pub const CPU_TRAIN_FLOPS: f64 = 1.0e9;
pub const CPU_DATA_FLOPS: f64 = 1.1e10;

/// The run's size and time estimate.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub steps: usize,
    pub epochs: f64,
    /// Tokens of the rows trained on (rows x row length, counting repeats; u128: steps x rows
    /// per update x row length may pass u64).
    pub tokens: u128,
    /// Block rows (anchors x block size) through the drafter.
    pub block_rows: u128,
    pub train_flops: f64,
    pub data_flops: f64,
}

impl Plan {
    /// The plan of `c` (resolved) on built-in rows, sampled from a target of `target_params`
    /// parameters (its layers and LM head).
    pub fn new(c: &RunConfig, draft: &DraftConfig, target_params: usize, train_rows: usize) -> Plan {
        let steps = c.total_steps(train_rows);
        let rows = steps as u128 * c.rows_per_update() as u128;
        let s = c.builtin_row_len() as f64;
        let d = &draft.dims;
        let (h, v, f) = (d.hidden_size as f64, d.vocab_size as f64, draft.num_features() as f64);
        let block_rows = rows * c.anchors as u128 * draft.block_size as u128;
        let per_row =
            6.0 * (f * h * h * s) + 6.0 * (num_params(draft) as f64 + h * v) * (c.anchors * draft.block_size) as f64;
        let train_flops = per_row * rows as f64;
        // Each sampled token runs the target over the whole sequence so far.
        let target_params = target_params as f64;
        let seq_sum: f64 = (0..c.continuation_len).map(|i| (c.prompt_len + i) as f64).sum();
        let data_flops = 2.0 * target_params * seq_sum * (c.rows + c.eval_rows) as f64;
        Plan {
            steps,
            epochs: rows as f64 / train_rows.max(1) as f64,
            tokens: rows * c.builtin_row_len() as u128,
            block_rows,
            train_flops,
            data_flops,
        }
    }

    /// Seconds, at the CPU rates above.
    pub fn estimated_seconds(&self) -> (f64, f64) {
        (self.data_flops / CPU_DATA_FLOPS, self.train_flops / CPU_TRAIN_FLOPS)
    }

    /// What `--plan` prints after the config.
    pub fn describe(&self) -> String {
        let (data, train) = self.estimated_seconds();
        format!(
            "steps: {}\nepochs: {:.2}\ntokens: {} ({} block rows through the drafter)\nestimated time on the CPU: {:.0}s ({:.0}s sampling the data, {:.0}s training; {:.1e} + {:.1e} FLOP at the rates measured on 2 cores)",
            self.steps,
            self.epochs,
            self.tokens,
            self.block_rows,
            data + train,
            data,
            train,
            self.data_flops,
            self.train_flops
        )
    }
}
