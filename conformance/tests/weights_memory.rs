//! The host memory of reading a checkpoint (`reference::io::WeightSet`), from a counting
//! allocator: opening a set maps its files and reads only their headers, and each tensor asked
//! for costs about its own bytes, so a target larger than the host's memory loads tensor by
//! tensor (a 27B hybrid is 54 GB of bf16).

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use dflash_conformance::heap::{measure, CountingAllocator};
use dflash_conformance::setups::randn;
use dflash_reference::io::{save_safetensors, WeightSet};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Heap besides the tensors: the maps' bookkeeping, the name index, error-free paths; 64 KiB
/// bounds them.
const BOOKKEEPING_BYTES: usize = 64 << 10;

#[test]
fn a_weight_set_reads_only_the_tensors_asked_for() {
    // 16 bf16 tensors of 256 x 1024 (512 KiB each, 8 MiB in all) over two shard files.
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let shape = [256usize, 1024];
    let mut files = Vec::new();
    for shard in 0..2 {
        let tensors: HashMap<String, Tensor> = (0..8)
            .map(|i| {
                let t = randn(&shape, &mut rng, DType::F32).unwrap().to_dtype(DType::BF16).unwrap();
                (format!("layers.{}.weight", shard * 8 + i), t)
            })
            .collect();
        let file = dir.path().join(format!("shard-{shard}.safetensors"));
        save_safetensors(&file, &tensors).unwrap();
        files.push(file);
    }
    let total: u64 = files.iter().map(|f| std::fs::metadata(f).unwrap().len()).sum();

    let (set, opened) = measure(|| WeightSet::load_files(&files[0], &files).unwrap());
    assert!(opened <= BOOKKEEPING_BYTES, "opening took {opened} bytes of a {total}-byte checkpoint");
    // One tensor in f32: its bf16 copy out of the map and its f32 conversion, and nothing else.
    let one = shape.iter().product::<usize>();
    let (t, read) = measure(|| set.get("layers.11.weight", &shape, DType::F32).unwrap());
    let bound = one * (2 + 4) + BOOKKEEPING_BYTES;
    assert!(read <= bound, "reading one tensor took {read} bytes; bound {bound} (the checkpoint is {total})");
    assert_eq!(t.dims(), shape);
    println!("checkpoint {total} bytes: opened with {opened}, one tensor read with {read}");
}
