//! Runtime switches of the engine's loss scaler and non-finite rule (`rp_model_set_grad_scaler`,
//! `rp_model_set_skip_nonfinite_steps`): a scaler switched on skips an overflowing step and
//! halves its scale (exact powers of two); switched off it reads 0 and keeps the skip count;
//! with the rule off a nan step runs and reaches the weights. Bad values change nothing.

use roundpipe::{DeviceKind, Loss, LossKind, Model, ModelOptions, Optimizer, Status, Tensor};

fn model() -> Model {
    let mut options = ModelOptions::new().unwrap();
    options
        .set_seed(3)
        .unwrap()
        .set_devices(DeviceKind::Cpu, 1)
        .unwrap();
    Model::new(
        r#"{"layers":[{"type":"linear","in":4,"out":2}]}"#,
        Some(&options),
    )
    .unwrap()
}

fn train(m: &mut Model, poison: bool) {
    let mut x = vec![0.25f32; 6 * 4];
    if poison {
        x[0] = f32::NAN;
    }
    let x = Tensor::new(&x, &[6, 4]).unwrap();
    let y = Tensor::new(&[0.5f32; 12], &[6, 2]).unwrap();
    let mse = Loss::new(LossKind::Mse).unwrap();
    m.forward_backward(&[&x], Some(&y), Some(&mse), None)
        .unwrap();
}

fn first_weight(m: &mut Model) -> f32 {
    m.synchronize().unwrap();
    m.param_master(0).unwrap().view().as_slice::<f32>().unwrap()[0]
}

#[test]
fn scaler_switched_on_skips_overflow_and_off_keeps_the_count() {
    let mut m = model();
    assert_eq!(m.grad_scale().unwrap(), (0.0, 0));
    m.set_grad_scaler(256.0, 1000).unwrap();
    assert_eq!(m.grad_scale().unwrap(), (256.0, 0));
    let sgd = Optimizer::sgd(0.1).unwrap();
    let before = first_weight(&mut m);
    train(&mut m, true);
    m.step(&sgd, false).unwrap();
    assert_eq!(m.grad_scale().unwrap(), (128.0, 1));
    assert_eq!(first_weight(&mut m).to_bits(), before.to_bits());

    let e = m.set_grad_scaler(-1.0, 1).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let e = m.set_grad_scaler(2.0, 0).unwrap_err();
    assert!(e.message().contains("growth_interval"), "{}", e.message());
    assert_eq!(m.grad_scale().unwrap(), (128.0, 1)); // refused: nothing changed

    m.set_grad_scaler(0.0, 1).unwrap();
    assert_eq!(m.grad_scale().unwrap(), (0.0, 1));
}

#[test]
fn nonfinite_step_runs_once_skipping_is_switched_off() {
    let mut m = model();
    let sgd = Optimizer::sgd(0.1).unwrap();
    train(&mut m, true);
    m.step(&sgd, false).unwrap(); // default: skipped
    assert!(first_weight(&mut m).is_finite());
    m.set_skip_nonfinite_steps(false).unwrap();
    train(&mut m, true);
    m.step(&sgd, false).unwrap();
    assert!(first_weight(&mut m).is_nan());
}
