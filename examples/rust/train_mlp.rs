//! train_mlp.rs - the shared training recipe (examples/RECIPE.md) through the safe Rust API.
//!
//! Builds a small MLP from a JSON spec, trains it for 20 asynchronous AdamW steps on a fixed
//! synthetic batch and prints one line per step. Standard output carries only the recipe's
//! lines, so the output can be compared with the C, Python and Julia examples line by line.
//!
//!     cd bindings/rust && cargo run --offline --example train_mlp
//!
//! (The example belongs to the `roundpipe` crate's manifest, which gives it the library's
//! rpath; `cargo test` also runs `train()` below and compares it with the C example.)

use roundpipe::{DeviceKind, Loss, LossKind, Model, ModelOptions, Optimizer, RunConfig, Tensor};

pub const SPEC: &str = r#"{"layers":[{"type":"linear","in":8,"out":32},{"type":"gelu"},{"type":"residual_mlp","dim":32,"hidden":64},{"type":"linear","in":32,"out":1}]}"#;
pub const ROWS: usize = 24;
pub const COLS: usize = 8;
pub const STEPS: usize = 20;
pub const MICROBATCHES: i32 = 3;
pub const SEED: u64 = 42;

/// The recipe's data: a 64-bit LCG (Knuth's MMIX constants) gives exact fp32 inputs in [-1, 1);
/// a row's label is the sum of the sines of its inputs, in f64, rounded once to f32.
pub fn make_data() -> (Vec<f32>, Vec<f32>) {
    let mut state: u64 = 42;
    let mut x = vec![0f32; ROWS * COLS];
    let mut y = vec![0f32; ROWS];
    for i in 0..ROWS {
        let mut sum = 0f64;
        for j in 0..COLS {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = (state >> 40) as f32 / 8388608.0 - 1.0;
            x[i * COLS + j] = v;
            sum += (v as f64).sin();
        }
        y[i] = sum as f32;
    }
    (x, y)
}

/// A model with the recipe's options: seed, 2 CPU devices, 3 microbatches per call.
pub fn create_model(seed: u64) -> roundpipe::Result<Model> {
    let mut config = RunConfig::new()?;
    config.set_num_microbatch(MICROBATCHES)?;
    let mut options = ModelOptions::new()?;
    options
        .set_seed(seed)?
        .set_devices(DeviceKind::Cpu, 2)?
        .set_run_config(Some(&config))?;
    Model::new(SPEC, Some(&options)) // the model copies what it needs from the options
}

/// What the recipe prints: the data check values and the loss of every step.
pub struct RecipeRun {
    pub data: [f64; 3],
    pub losses: Vec<f64>,
}

/// Run the recipe.
pub fn train() -> roundpipe::Result<RecipeRun> {
    let (x, y) = make_data();
    let x = Tensor::new(&x, &[ROWS as i64, COLS as i64])?;
    let y = Tensor::new(&y, &[ROWS as i64, 1])?;
    let first = (
        x.as_slice::<f32>()?[0],
        x.as_slice::<f32>()?[1],
        y.as_slice::<f32>()?[0],
    );

    let mut model = create_model(SEED)?;
    eprintln!(
        "roundpipe {}: {} stage(s) on {} device(s)",
        roundpipe::version(),
        model.num_stages()?,
        model.num_devices()?
    );

    // Mean squared error per microbatch; scaling by 1/3 makes the summed loss the batch mean.
    let loss = Loss::new(LossKind::Mse)?.with_scale(1.0 / MICROBATCHES as f64)?;
    let adamw = Optimizer::adamw(1e-2)?;

    let mut losses = Vec::with_capacity(STEPS);
    for _ in 0..STEPS {
        losses.push(model.forward_backward(&[&x], Some(&y), Some(&loss), None)?);
        // Asynchronous: the update runs on the optimizer thread while the next
        // forward_backward already computes, on weights one step old.
        model.step(&adamw, true)?;
    }
    model.synchronize()?; // wait for the last step and publish its weights
    Ok(RecipeRun {
        data: [first.0 as f64, first.1 as f64, first.2 as f64],
        losses,
    })
}

#[allow(dead_code)] // also compiled as a module of the crate's tests, which call train()
fn main() {
    let run = match train() {
        Ok(run) => run,
        Err(e) => {
            eprintln!("error: {}", e);
            std::process::exit(1);
        }
    };
    println!("data {:?} {:?} {:?}", run.data[0], run.data[1], run.data[2]);
    for (step, value) in run.losses.iter().enumerate() {
        println!("step {} loss {:?}", step, value);
    }
    let (first, last) = (run.losses[0], run.losses[STEPS - 1]);
    let fell = last < first; // false for NaN too
    if !fell {
        eprintln!("error: the loss did not fall ({} -> {})", first, last);
        std::process::exit(1);
    }
}
