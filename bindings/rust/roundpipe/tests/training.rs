//! Training through the safe API: the shared recipe (examples/RECIPE.md), its agreement with
//! the C example, and the callback paths checked against the built-in computations.

use std::path::PathBuf;
use std::process::Command;

use roundpipe::{DType, Loss, LossInput, LossKind, Optimizer, Status, Tensor};

// The Rust example itself, so that the test runs exactly the code a reader sees.
#[path = "../../../../examples/rust/train_mlp.rs"]
mod example;

fn recipe_tensors() -> (Tensor, Tensor) {
    let (x, y) = example::make_data();
    (
        Tensor::new(&x, &[example::ROWS as i64, example::COLS as i64]).unwrap(),
        Tensor::new(&y, &[example::ROWS as i64, 1]).unwrap(),
    )
}

fn rel_diff(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(b.abs()).max(f64::MIN_POSITIVE)
}

#[test]
fn recipe_data_matches_the_check_values_in_recipe_md() {
    // Values computed independently (Python, exact integer arithmetic) and written in RECIPE.md.
    let (x, y) = example::make_data();
    assert_eq!(x[0] as f64, 0.136460542678833);
    assert_eq!(x[1] as f64, -0.5490732192993164);
    assert_eq!(y[0] as f64, -2.218505382537842);
    assert_eq!(x[23 * 8 + 7] as f64, 0.02287578582763672);
    assert_eq!(y[23] as f64, 0.6170184016227722);
}

#[test]
fn recipe_training_loss_falls() {
    let run = example::train().expect("the recipe trains");
    assert_eq!(run.losses.len(), example::STEPS);
    assert!(run.losses.iter().all(|l| l.is_finite()), "{:?}", run.losses);
    // As RECIPE.md says: the last loss is below the first, and the lowest well below half of
    // it (the path swings: lr 1e-2 on one-step-stale gradients).
    let (first, last) = (run.losses[0], run.losses[example::STEPS - 1]);
    let lowest = run.losses.iter().cloned().fold(f64::INFINITY, f64::min);
    assert!(last < first, "the loss did not fall: {:?}", run.losses);
    assert!(
        lowest < 0.5 * first,
        "the loss never halved: {:?}",
        run.losses
    );
    // Staleness one: the second call still runs on the initial weights.
    assert_eq!(run.losses[1], run.losses[0], "{:?}", run.losses);
}

#[test]
fn recipe_training_is_deterministic() {
    let a = example::train().unwrap();
    let b = example::train().unwrap();
    assert_eq!(
        a.losses, b.losses,
        "CPU devices with a fixed seed must repeat exactly"
    );
}

/// The C example's binary: $ROUNDPIPE_C_EXAMPLE, else train_mlp in the build tree.
fn c_example() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ROUNDPIPE_C_EXAMPLE") {
        return Some(PathBuf::from(p));
    }
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("ROUNDPIPE_LIB_DIR") {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../build"));
    dirs.into_iter()
        .map(|d| d.join("examples/c/train_mlp"))
        .find(|p| p.is_file())
}

fn parse_recipe_output(text: &str) -> (Vec<f64>, Vec<f64>) {
    let mut data = Vec::new();
    let mut losses = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["data", rest @ ..] => data = rest.iter().map(|w| w.parse().unwrap()).collect(),
            ["step", k, "loss", v] => {
                assert_eq!(
                    k.parse::<usize>().unwrap(),
                    losses.len(),
                    "steps out of order: {}",
                    text
                );
                losses.push(v.parse().unwrap());
            }
            _ => panic!("unexpected line in the C example's output: {:?}", line),
        }
    }
    (data, losses)
}

#[test]
fn recipe_losses_equal_the_c_example() {
    let exe = match c_example() {
        Some(p) => p,
        None => {
            if std::env::var_os("ROUNDPIPE_REQUIRE_C_EXAMPLE").is_some() {
                panic!("the C example (examples/c/train_mlp) is not built");
            }
            eprintln!("skipped: the C example binary is not built (set ROUNDPIPE_C_EXAMPLE)");
            return;
        }
    };
    let out = Command::new(&exe).output().expect("run the C example");
    assert!(
        out.status.success(),
        "{} failed:\n{}",
        exe.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let (c_data, c_losses) = parse_recipe_output(&String::from_utf8_lossy(&out.stdout));

    let run = example::train().unwrap();
    assert_eq!(
        c_data,
        run.data.to_vec(),
        "the C and Rust examples generate different data"
    );
    assert_eq!(c_losses.len(), run.losses.len());
    for (step, (c, r)) in c_losses.iter().zip(&run.losses).enumerate() {
        // fp32 relative precision is 6e-8; the engine is deterministic on CPU devices, so the
        // two languages should agree exactly, and must agree to 1e-6.
        assert!(
            rel_diff(*c, *r) <= 1e-6,
            "step {}: C {} vs Rust {}",
            step,
            c,
            r
        );
    }
}

#[test]
fn first_loss_equals_mse_of_the_forward_outputs() {
    // The loss of forward_backward, recomputed here from rp_forward's outputs and the labels.
    let (x, y) = recipe_tensors();
    let mut model = example::create_model(example::SEED).unwrap();
    let outputs = model.forward(&[&x], None).unwrap();
    assert_eq!(outputs.len(), 1);
    assert_eq!(outputs[0].shape(), &[24, 1]);
    assert_eq!(outputs[0].dtype(), Some(DType::F32));
    let out = outputs[0].to_vec::<f32>().unwrap();
    let labels = y.as_slice::<f32>().unwrap();
    // Per microbatch (8 rows each) mean, times 1/3, summed: the batch mean.
    let expected: f64 = out
        .iter()
        .zip(labels)
        .map(|(o, l)| ((o - l) as f64).powi(2))
        .sum::<f64>()
        / out.len() as f64;

    let loss = Loss::new(LossKind::Mse)
        .unwrap()
        .with_scale(1.0 / 3.0)
        .unwrap();
    let got = model
        .forward_backward(&[&x], Some(&y), Some(&loss), None)
        .unwrap();
    assert!(
        rel_diff(got, expected) <= 1e-5,
        "forward_backward {} vs recomputed {}",
        got,
        expected
    );
}

/// MSE written in Rust: loss = mean((o - l)^2), grad = 2 (o - l) / n (the scale is applied by
/// the library to both).
fn rust_mse(input: LossInput<'_>) -> Result<(f64, Tensor), String> {
    let o = input.outputs.as_slice::<f32>().map_err(|e| e.to_string())?;
    let l = input
        .labels
        .ok_or("no labels")?
        .as_slice::<f32>()
        .map_err(|e| e.to_string())?;
    if o.len() != l.len() {
        return Err(format!("{} outputs, {} labels", o.len(), l.len()));
    }
    let n = o.len() as f64;
    let loss = o
        .iter()
        .zip(l)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        / n;
    let grad: Vec<f32> = o
        .iter()
        .zip(l)
        .map(|(a, b)| (2.0 * (a - b) as f64 / n) as f32)
        .collect();
    Ok((
        loss,
        Tensor::new(&grad, input.outputs.shape()).map_err(|e| e.to_string())?,
    ))
}

#[test]
fn loss_callback_trains_like_the_builtin_mse() {
    let (x, y) = recipe_tensors();
    let builtin = Loss::new(LossKind::Mse)
        .unwrap()
        .with_scale(1.0 / 3.0)
        .unwrap();
    let callback = Loss::from_fn(rust_mse)
        .unwrap()
        .with_scale(1.0 / 3.0)
        .unwrap();
    let adamw = Optimizer::adamw(1e-2).unwrap();
    let mut a = example::create_model(example::SEED).unwrap();
    let mut b = example::create_model(example::SEED).unwrap();
    for step in 0..5 {
        let la = a
            .forward_backward(&[&x], Some(&y), Some(&builtin), None)
            .unwrap();
        let lb = b
            .forward_backward(&[&x], Some(&y), Some(&callback), None)
            .unwrap();
        // Same math in f64 (Rust) and f32 (engine): agreement to fp32 rounding of a sum.
        assert!(
            rel_diff(la, lb) <= 1e-5,
            "step {}: built-in {} vs callback {}",
            step,
            la,
            lb
        );
        a.step(&adamw, true).unwrap();
        b.step(&adamw, true).unwrap();
    }
}

#[test]
fn loss_callback_error_and_panic_become_callback_errors() {
    let (x, y) = recipe_tensors();
    let mut model = example::create_model(1).unwrap();

    let failing = Loss::from_fn(|_: LossInput<'_>| Err("labels look wrong".to_string())).unwrap();
    let e = model
        .forward_backward(&[&x], Some(&y), Some(&failing), None)
        .unwrap_err();
    assert_eq!(e.status(), Status::Callback);
    assert!(e.message().contains("labels look wrong"), "{}", e);

    let panicking = Loss::from_fn(|_: LossInput<'_>| -> Result<(f64, Tensor), String> {
        panic!("boom in loss")
    })
    .unwrap();
    let e = model
        .forward_backward(&[&x], Some(&y), Some(&panicking), None)
        .unwrap_err();
    assert_eq!(e.status(), Status::Callback);
    assert!(
        e.message().contains("panicked") && e.message().contains("boom in loss"),
        "{}",
        e
    );

    // The model is still usable.
    let mse = Loss::new(LossKind::Mse).unwrap();
    assert!(model
        .forward_backward(&[&x], Some(&y), Some(&mse), None)
        .unwrap()
        .is_finite());
}

#[test]
fn step_callback_sgd_equals_builtin_sgd() {
    let (x, y) = recipe_tensors();
    let loss = Loss::new(LossKind::Mse).unwrap();
    let lr = 0.05;
    let sgd = Optimizer::sgd(lr).unwrap();
    let mut a = example::create_model(example::SEED).unwrap();
    let mut b = example::create_model(example::SEED).unwrap();
    for _ in 0..3 {
        a.forward_backward(&[&x], Some(&y), Some(&loss), None)
            .unwrap();
        a.step(&sgd, false).unwrap();
        b.forward_backward(&[&x], Some(&y), Some(&loss), None)
            .unwrap();
        b.step_with(
            move |ctx| {
                for i in 0..ctx.param_count().map_err(|e| e.to_string())? {
                    let g = ctx
                        .grad(i)
                        .map_err(|e| e.to_string())?
                        .to_vec::<f32>()
                        .map_err(|e| e.to_string())?;
                    let mut w = ctx.master(i).map_err(|e| e.to_string())?;
                    for (w, g) in w
                        .as_mut_slice::<f32>()
                        .map_err(|e| e.to_string())?
                        .iter_mut()
                        .zip(&g)
                    {
                        *w -= (lr as f32) * g;
                    }
                }
                Ok(())
            },
            false,
        )
        .unwrap();
    }
    a.synchronize().unwrap();
    b.synchronize().unwrap();
    assert_eq!(a.param_count().unwrap(), b.param_count().unwrap());
    for i in 0..a.param_count().unwrap() {
        let wa = a.param_master(i).unwrap().to_vec::<f32>().unwrap();
        let wb = b.param_master(i).unwrap().to_vec::<f32>().unwrap();
        for (p, q) in wa.iter().zip(&wb) {
            // w - lr * g in fp32 either way; allow one rounding of difference.
            assert!(
                (p - q).abs() <= 1e-6 * p.abs().max(1.0),
                "param {}: {} vs {}",
                i,
                p,
                q
            );
        }
    }
}

#[test]
fn failed_async_step_callback_is_reported_by_synchronize() {
    let (x, y) = recipe_tensors();
    let loss = Loss::new(LossKind::Mse).unwrap();
    let mut model = example::create_model(3).unwrap();
    model
        .forward_backward(&[&x], Some(&y), Some(&loss), None)
        .unwrap();
    model
        .step_with(|_| Err("refusing this step".to_string()), true)
        .unwrap();
    let e = model.synchronize().unwrap_err();
    assert_eq!(e.status(), Status::Callback);
    assert!(e.message().contains("refusing this step"), "{}", e);
}

#[test]
fn parameters_follow_the_spec() {
    // Names, order and shapes as docs/semantics.md describes them for the recipe's spec.
    let model = example::create_model(example::SEED).unwrap();
    let expected: Vec<(&str, Vec<i64>)> = vec![
        ("0.weight", vec![32, 8]),
        ("0.bias", vec![32]),
        ("2.norm.weight", vec![32]),
        ("2.norm.bias", vec![32]),
        ("2.fc1.weight", vec![64, 32]),
        ("2.fc1.bias", vec![64]),
        ("2.fc2.weight", vec![32, 64]),
        ("2.fc2.bias", vec![32]),
        ("3.weight", vec![1, 32]),
        ("3.bias", vec![1]),
    ];
    assert_eq!(model.num_layers().unwrap(), 4);
    assert_eq!(model.num_devices().unwrap(), 2);
    assert_eq!(model.param_count().unwrap(), expected.len());
    for (i, (name, shape)) in expected.iter().enumerate() {
        assert_eq!(model.param_name(i).unwrap(), *name);
        assert_eq!(model.param_find(name).unwrap(), i);
        assert_eq!(&model.param_shape(i).unwrap(), shape);
    }
}

#[test]
fn saved_weights_load_into_another_model() {
    let (x, _) = recipe_tensors();
    let mut a = example::create_model(example::SEED).unwrap();
    let mut b = example::create_model(7).unwrap();
    let dir = std::env::temp_dir().join(format!("roundpipe-rust-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("weights.safetensors");
    a.save(&path).unwrap();
    let before = b.forward(&[&x], None).unwrap()[0].to_vec::<f32>().unwrap();
    b.load(&path).unwrap();
    let after = b.forward(&[&x], None).unwrap()[0].to_vec::<f32>().unwrap();
    let want = a.forward(&[&x], None).unwrap()[0].to_vec::<f32>().unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_ne!(before, want, "two seeds should give two different models");
    assert_eq!(
        after, want,
        "same fp32 weights, same engine: identical outputs"
    );
}

#[test]
fn step_context_says_which_gradients_the_step_received() {
    let (x, y) = recipe_tensors();
    let loss = Loss::new(LossKind::Mse).unwrap();
    let mut model = example::create_model(example::SEED).unwrap();
    // Each step records what its own gradients hold: every parameter after a call, none in a
    // step with no call before it (the engine's step skips such parameters).
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    for with_call in [true, false] {
        if with_call {
            model
                .forward_backward(&[&x], Some(&y), Some(&loss), None)
                .unwrap();
        }
        let seen = seen.clone();
        model
            .step_with(
                move |ctx| {
                    let mut got = Vec::new();
                    for i in 0..ctx.param_count().map_err(|e| e.to_string())? {
                        got.push(ctx.grad_received(i).map_err(|e| e.to_string())?);
                    }
                    seen.lock().unwrap().push(got);
                    Ok(())
                },
                false,
            )
            .unwrap();
    }
    let seen = seen.lock().unwrap();
    let count = model.param_count().unwrap();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0], vec![true; count], "after a call");
    assert_eq!(seen[1], vec![false; count], "a step with no call before it");
}
