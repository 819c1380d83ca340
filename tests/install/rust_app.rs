// A Rust user's program, outside the repository, that depends on `roundpipe` by path
// (tests/install/check_rust_path_dependency.sh writes its Cargo.toml). It trains a linear model
// on y = x . w + 1 with the engine's AdamW, requires the loss to fall to a hundredth, and reads
// the trace of the last call.
use roundpipe::{DeviceKind, Loss, LossKind, Model, ModelOptions, Optimizer, RunConfig, Tensor};

fn main() -> roundpipe::Result<()> {
    println!(
        "roundpipe {}, ABI {}, built against torch {}",
        roundpipe::version(),
        roundpipe::abi_version(),
        roundpipe::torch_version()
    );
    let w = [0.5f32, -1.0, 0.25, 2.0];
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut state: u32 = 12345;
    for _ in 0..32 {
        let mut target = 1.0f32;
        for wj in &w {
            state = state.wrapping_mul(1664525).wrapping_add(1013904223);
            let v = (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0; // uniform in [-1, 1)
            x.push(v);
            target += wj * v;
        }
        y.push(target);
    }
    let x = Tensor::new(&x, &[32, 4])?;
    let y = Tensor::new(&y, &[32, 1])?;

    let mut config = RunConfig::new()?;
    config.set_num_microbatch(2)?;
    let mut options = ModelOptions::new()?;
    options.set_seed(1)?.set_devices(DeviceKind::Cpu, 1)?.set_run_config(Some(&config))?;
    let mut model = Model::new(
        r#"{"layers": [{"type": "linear", "in": 4, "out": 1}]}"#,
        Some(&options),
    )?;
    let loss = Loss::new(LossKind::Mse)?.with_scale(0.5)?;
    let adamw = Optimizer::adamw(0.05)?;
    let mut losses = Vec::new();
    for _ in 0..300 {
        losses.push(model.forward_backward(&[&x], Some(&y), Some(&loss), None)?);
        model.step(&adamw, true)?;
    }
    model.synchronize()?;
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!("loss {} -> {}", first, last);
    let trace = model.trace_json()?;
    println!("trace of the last call: {} bytes of JSON", trace.len());
    if !(last < first / 100.0) || !trace.contains("\"compute\"") {
        eprintln!("error: the loss did not fall to a hundredth, or the trace has no compute");
        std::process::exit(1);
    }
    Ok(())
}
