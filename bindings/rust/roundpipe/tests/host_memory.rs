//! Host memory modes: `ModelOptions::set_host_memory_mode` and `Model::host_state_bytes`.
//!
//! Bytes per parameter once a built-in AdamW step has allocated the moments (the header's
//! `rp_host_memory_mode` comment; tensor bytes, so exact multiples of the element count):
//! standard 24 for bf16 models, 28 for f32 ones; saving 12 for both.

use roundpipe::{DType, FloatType, HostMemoryMode, Loss, LossKind, Model, Optimizer};

mod common;
use common::{batch, mlp as model};

const ELEMENTS: i64 = 8 * 16 + 16 + 16 + 1;

fn train(model: &mut Model, steps: usize) -> Vec<f64> {
    let (x, y) = batch(0);
    let loss = Loss::new(LossKind::Mse)
        .unwrap()
        .with_scale(1.0 / 3.0)
        .unwrap();
    let adamw = Optimizer::adamw(1e-2).unwrap();
    let mut losses = Vec::new();
    for _ in 0..steps {
        losses.push(
            model
                .forward_backward(&[&x], Some(&y), Some(&loss), None)
                .unwrap(),
        );
        model.step(&adamw, true).unwrap();
    }
    model.synchronize().unwrap();
    losses
}

#[test]
fn the_default_mode_is_standard() {
    assert_eq!(HostMemoryMode::default(), HostMemoryMode::Standard);
}

#[test]
fn saving_mode_trains_a_bf16_model() {
    let mut m = model(HostMemoryMode::Saving, FloatType::BF16);
    let losses = train(&mut m, 20);
    assert!(losses.iter().all(|l| l.is_finite()), "{:?}", losses);
    let best_late = losses[15..].iter().cloned().fold(f64::INFINITY, f64::min);
    assert!(best_late < 0.5 * losses[0], "{:?}", losses);
}

#[test]
fn host_state_bytes_per_parameter_after_a_step() {
    for &(mode, dtype, per_param) in &[
        (HostMemoryMode::Standard, FloatType::BF16, 24),
        (HostMemoryMode::Standard, FloatType::F32, 28),
        (HostMemoryMode::Saving, FloatType::BF16, 12),
        (HostMemoryMode::Saving, FloatType::F32, 12),
    ] {
        let mut m = model(mode, dtype);
        train(&mut m, 1);
        let got = m.host_state_bytes().unwrap();
        assert_eq!(got.elements, ELEMENTS, "{:?} {:?}", mode, dtype);
        assert_eq!(got.bytes, per_param * ELEMENTS, "{:?} {:?}", mode, dtype);
        assert_eq!(got.bytes_per_param(), per_param as f64);
    }
}

#[test]
fn step_closures_see_bf16_gradients_in_saving_mode() {
    for &(mode, want) in &[
        (HostMemoryMode::Standard, DType::F32),
        (HostMemoryMode::Saving, DType::BF16),
    ] {
        let mut m = model(mode, FloatType::BF16);
        let (x, y) = batch(0);
        let loss = Loss::new(LossKind::Mse).unwrap();
        m.forward_backward(&[&x], Some(&y), Some(&loss), None)
            .unwrap();
        m.step_with(
            move |ctx| {
                for i in 0..ctx.param_count().map_err(|e| e.to_string())? {
                    let g = ctx.grad(i).map_err(|e| e.to_string())?;
                    let w = ctx.master(i).map_err(|e| e.to_string())?;
                    if g.dtype() != Some(want) || w.dtype() != Some(DType::F32) {
                        return Err(format!(
                            "parameter {}: grad {:?}, master {:?}",
                            i,
                            g.dtype(),
                            w.dtype()
                        ));
                    }
                }
                Ok(())
            },
            false,
        )
        .unwrap();
    }
}
