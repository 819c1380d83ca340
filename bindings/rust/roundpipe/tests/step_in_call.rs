//! In-call steps (`Model::set_step_in_call`, `rp_model_set_step_in_call`): in a saving-mode
//! model each `forward_backward` is also the optimizer step, leaving the weights of
//! `forward_backward` followed by a synchronous `step`, bit for bit (the header's promise);
//! explicit steps are refused while it is on and come back with `None`; a standard-mode model
//! refuses it.

use roundpipe::{FloatType, HostMemoryMode, Loss, LossKind, Model, Optimizer, Status};

mod common;
use common::batch;

const CALLS: usize = 4;

fn model(mode: HostMemoryMode) -> Model {
    common::mlp(mode, FloatType::F32)
}

fn call(m: &mut Model, i: usize) -> f64 {
    let (x, y) = batch(13 * i);
    let loss = Loss::new(LossKind::Mse)
        .unwrap()
        .with_scale(1.0 / 3.0)
        .unwrap();
    m.forward_backward(&[&x], Some(&y), Some(&loss), None)
        .unwrap()
}

/// Every master weight (synchronizes first), as bits.
fn weights(m: &mut Model) -> Vec<Vec<u32>> {
    m.synchronize().unwrap();
    (0..m.param_count().unwrap())
        .map(|i| {
            let w: Vec<f32> = m.param_master(i).unwrap().view().to_vec().unwrap();
            w.iter().map(|v| v.to_bits()).collect()
        })
        .collect()
}

#[test]
fn in_call_steps_equal_explicit_synchronous_steps_bit_for_bit() {
    let adamw = Optimizer::adamw(1e-2).unwrap();
    let mut inside = model(HostMemoryMode::Saving);
    let mut explicit = model(HostMemoryMode::Saving);
    let initial = weights(&mut inside);
    assert_eq!(weights(&mut explicit), initial);

    assert!(!inside.step_in_call().unwrap());
    inside.set_step_in_call(Some(&adamw)).unwrap();
    assert!(inside.step_in_call().unwrap());
    assert!(!explicit.step_in_call().unwrap());

    let got: Vec<f64> = (0..CALLS).map(|i| call(&mut inside, i)).collect();
    let mut want = Vec::new();
    for i in 0..CALLS {
        want.push(call(&mut explicit, i));
        explicit.step(&adamw, false).unwrap();
    }
    let trained = weights(&mut inside);

    // Not a no-op: every call stepped and every parameter moved.
    assert_eq!(inside.step_count().unwrap(), CALLS as i64);
    assert_eq!(explicit.step_count().unwrap(), CALLS as i64);
    for (p, (t, w0)) in trained.iter().zip(&initial).enumerate() {
        assert_ne!(t, w0, "parameter {} did not change", p);
    }
    assert_ne!(got[1], got[0], "{:?}", got);
    assert_eq!(got, want);
    assert_eq!(trained, weights(&mut explicit));
    assert!(inside.step_in_call().unwrap());
}

#[test]
fn explicit_steps_are_refused_while_on_and_come_back_with_none() {
    let adamw = Optimizer::adamw(1e-2).unwrap();
    let mut m = model(HostMemoryMode::Saving);

    // Gradients held since the last step: refused, nothing changed.
    call(&mut m, 0);
    let e = m.set_step_in_call(Some(&adamw)).unwrap_err();
    assert_eq!(e.status(), Status::State);
    assert!(!m.step_in_call().unwrap());
    m.zero_grad().unwrap();

    m.set_step_in_call(Some(&adamw)).unwrap();
    call(&mut m, 1);
    let before = weights(&mut m);
    assert_eq!(m.step_count().unwrap(), 1);
    for &is_async in &[true, false] {
        let e = m.step(&adamw, is_async).unwrap_err();
        assert_eq!(e.status(), Status::State);
        let e = m.step_with(|_| Ok(()), is_async).unwrap_err();
        assert_eq!(e.status(), Status::State);
    }
    assert!(m.step_in_call().unwrap());
    assert_eq!(m.step_count().unwrap(), 1);
    assert_eq!(weights(&mut m), before);

    m.set_step_in_call(None).unwrap();
    assert!(!m.step_in_call().unwrap());
    call(&mut m, 2);
    assert_eq!(weights(&mut m), before, "no in-call step once switched off");
    m.step(&adamw, false).unwrap();
    assert_eq!(m.step_count().unwrap(), 2);
    let after = weights(&mut m);
    for (p, (a, b)) in after.iter().zip(&before).enumerate() {
        assert_ne!(a, b, "parameter {} did not change", p);
    }
}

#[test]
fn standard_mode_refuses_in_call_steps() {
    let adamw = Optimizer::adamw(1e-2).unwrap();
    let mut m = model(HostMemoryMode::Standard);
    let e = m.set_step_in_call(Some(&adamw)).unwrap_err();
    assert_eq!(e.status(), Status::State);
    assert!(!m.step_in_call().unwrap());
    call(&mut m, 0);
    m.step(&adamw, false).unwrap();
    assert_eq!(m.step_count().unwrap(), 1);
}
