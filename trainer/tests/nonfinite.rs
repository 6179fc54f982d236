//! Non-finite steps: the step is reported (step, rows, tensor), skipped without an update and
//! counted; the run stops after `max_nonfinite_in_a_row` such steps in a row.

mod common;

use std::collections::BTreeSet;

use candle_core::{Tensor, Var};
use common::{engine, fresh_seed, inputs, setup, tiny_config};
use dflash_trainer::config::StepKind;
use dflash_trainer::engine::{first_non_finite, CpuEngine, EngineState, StepBatch, StepEngine, StepOutcome};
use dflash_trainer::metrics;
use dflash_trainer::run::Trainer;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The CPU engine, with a NaN planted in one weight on the chosen steps (restored after), so
/// that the real loss comes out NaN; records whether each poisoned step changed the weights.
struct Poisoned {
    inner: CpuEngine,
    steps: BTreeSet<usize>,
    unchanged: Vec<bool>,
}

fn weights(e: &CpuEngine) -> Vec<Vec<f32>> {
    e.state().unwrap().params.iter().map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect()
}

impl StepEngine for Poisoned {
    fn name(&self) -> String {
        "poisoned".into()
    }
    fn step(&mut self, batch: &StepBatch, rng: &mut ChaCha8Rng) -> dflash_trainer::Result<StepOutcome> {
        if !self.steps.contains(&batch.step) {
            return self.inner.step(batch, rng);
        }
        let before = weights(&self.inner);
        let var: Var = self.inner.drafter()?.named_params().iter().find(|(n, _)| n == "norm.weight").unwrap().1.clone();
        let saved = var.as_tensor().copy()?;
        var.set(&(var.as_tensor() * f64::NAN)?)?;
        let outcome = self.inner.step(batch, rng);
        var.set(&saved)?;
        self.unchanged.push(weights(&self.inner) == before);
        outcome
    }
    fn state(&self) -> dflash_trainer::Result<EngineState> {
        self.inner.state()
    }
    fn restore(&mut self, state: &EngineState) -> dflash_trainer::Result<()> {
        self.inner.restore(state)
    }
    fn drafter(&mut self) -> dflash_trainer::Result<&dflash_reference::drafter::Drafter> {
        self.inner.drafter()
    }
    fn evaluate(
        &mut self,
        rows: &dyn dflash_trainer::rows::RowSource,
        max_anchors: usize,
        gamma: f64,
        seed: u64,
    ) -> dflash_trainer::Result<dflash_reference::eval::EvalReport> {
        self.inner.evaluate(rows, max_anchors, gamma, seed)
    }
}

/// Isolated NaN steps are skipped (no update), reported in metrics.jsonl with their rows and
/// counted; the run goes on. K in a row stop it with an error naming the step and the tensor.
#[test]
fn non_finite_steps_are_skipped_counted_and_stop_the_run_after_k_in_a_row() {
    let seed = fresh_seed();
    let dir = tempfile::tempdir().unwrap();
    let steps = 10;
    let mut c = tiny_config(dir.path(), seed, steps);
    c.max_nonfinite_in_a_row = 3;
    let s = setup(&c);
    // Two isolated NaN steps and a pair: never 3 in a row.
    let first = rand::rng().random_range(1..3);
    let poisoned: BTreeSet<usize> = [first, first + 3, first + 4].into();
    let mut e = Poisoned { inner: engine(&c, &s, StepKind::Reference), steps: poisoned.clone(), unchanged: Vec::new() };
    let summary = Trainer::new(inputs(&c, &s)).unwrap().run(&mut e).expect("the run goes on");
    assert_eq!(summary.skipped_total, 3);
    assert_eq!(e.unchanged, vec![true; 3], "a skipped step does not update the weights");
    let lines = metrics::read_lines(&metrics::metrics_file(dir.path())).unwrap();
    let skipped: Vec<_> = lines.iter().filter(|v| v["kind"] == "skipped").collect();
    assert_eq!(skipped.iter().map(|v| v["step"].as_u64().unwrap() as usize).collect::<BTreeSet<_>>(), poisoned);
    for v in &skipped {
        assert_eq!(v["tensor"], "loss");
        assert_eq!(v["rows"].as_array().unwrap().len(), c.rows_per_step);
    }
    assert_eq!(skipped.last().unwrap()["in_a_row"], 2);
    let train_steps: BTreeSet<usize> =
        lines.iter().filter(|v| v["kind"] == "train").map(|v| v["step"].as_u64().unwrap() as usize).collect();
    assert_eq!(train_steps, (0..steps).filter(|s| !poisoned.contains(s)).collect());
    assert_eq!(lines.iter().rev().find(|v| v["kind"] == "train").unwrap()["skipped_total"], 3);
    // The AdamW step count counts updates only.
    assert_eq!(e.state().unwrap().t as usize, steps - 3);

    // Three in a row: stopped at the third, no checkpoint.
    let dir = tempfile::tempdir().unwrap();
    let mut c = tiny_config(dir.path(), seed, steps);
    (c.max_nonfinite_in_a_row, c.checkpoint_every) = (3, 100);
    let start = rand::rng().random_range(0..5);
    let mut e = Poisoned {
        inner: engine(&c, &s, StepKind::Reference),
        steps: (start..start + 3).collect(),
        unchanged: Vec::new(),
    };
    let message = Trainer::new(inputs(&c, &s)).unwrap().run(&mut e).unwrap_err().to_string();
    assert!(message.contains(&format!("stopped at step {}", start + 2)), "{message}");
    assert!(message.contains("3 steps in a row") && message.contains("loss"), "{message}");
    assert!(!dir.path().join("latest").exists());
}

/// A gradient holding NaN or Inf is named (the loss may be finite while a gradient is not).
#[test]
fn a_non_finite_gradient_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let c = tiny_config(dir.path(), fresh_seed(), 1);
    let s = setup(&c);
    let drafter = dflash_trainer::builtin::init_drafter(&c, &s.draft_config).unwrap();
    let params = drafter.named_params();
    let i = rand::rng().random_range(0..params.len());
    let bad = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY][rand::rng().random_range(0..3)];
    let grads: Vec<Tensor> = params
        .iter()
        .enumerate()
        .map(|(j, (_, v))| {
            let g = v.as_tensor().ones_like().unwrap();
            if j == i {
                (g * bad).unwrap()
            } else {
                g
            }
        })
        .collect();
    assert_eq!(first_non_finite(&drafter, &grads).unwrap(), Some(format!("gradient of {}", params[i].0)));
    let fine: Vec<Tensor> = params.iter().map(|(_, v)| v.as_tensor().ones_like().unwrap()).collect();
    assert_eq!(first_non_finite(&drafter, &fine).unwrap(), None);
}
