//! Upstream's non-fused training from Rust: `forward_train`, then `backward` with the caller's
//! gradients of the outputs, checked against gradients worked out by hand for one linear layer.

use roundpipe::{DeviceKind, Model, ModelOptions, Status, Tensor};

#[test]
fn backward_of_a_linear_layer_gives_the_hand_computed_gradients() {
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cpu, 2).unwrap();
    let mut model = Model::new(
        r#"{"layers":[{"type":"linear","in":2,"out":1}]}"#,
        Some(&options),
    )
    .unwrap();
    // y = w . x + b for 4 rows; with dL/dy = g per row, dL/dw = sum_r g_r x_r and dL/db = sum g.
    let x = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0], &[4, 2]).unwrap();
    let g = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &[4, 1]).unwrap();
    let outputs = model.forward_train(&[&x], None).unwrap();
    assert_eq!(outputs.len(), 1);
    model.backward(&[Some(&g)]).unwrap();
    let w_grad: Vec<f32> = model.param_grad(0).unwrap().view().to_vec().unwrap();
    let b_grad: Vec<f32> = model.param_grad(1).unwrap().view().to_vec().unwrap();
    let want_w = [1.0 - 6.0 - 0.5 + 0.0, 2.0 - 8.0 + 0.25 + 6.0];
    for (got, want) in w_grad.iter().zip(want_w) {
        assert!((got - want).abs() <= 1e-6, "{:?} vs {:?}", w_grad, want_w);
    }
    assert!((b_grad[0] - 2.5).abs() <= 1e-6, "{:?}", b_grad);
    // Each forward can be back-propagated once.
    let again = model.backward(&[Some(&g)]).unwrap_err();
    assert_eq!(again.status(), Status::State);
}

/// `backward_input_grads`: for y = w . x + b, dL/dx_r = g_r w (hand-computed from the weights
/// the model holds); an integer input beside it gets `None`.
#[test]
fn backward_input_grads_of_a_linear_layer_are_g_times_w() {
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cpu, 1).unwrap();
    let mut model = Model::new(
        r#"{"layers":[{"type":"linear","in":2,"out":1}]}"#,
        Some(&options),
    )
    .unwrap();
    let w: Vec<f32> = model.param_master(0).unwrap().view().to_vec().unwrap();
    let x = Tensor::new(&[1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0], &[4, 2]).unwrap();
    let ids = Tensor::new(&[0i64, 1, 2, 3], &[4]).unwrap();
    let g = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0], &[4, 1]).unwrap();
    model.forward_train(&[&x, &ids], None).unwrap();
    let grads = model.backward_input_grads(&[Some(&g)]).unwrap();
    assert_eq!(grads.len(), 2);
    assert!(grads[1].is_none());
    let dx: Vec<f32> = grads[0].as_ref().unwrap().view().to_vec().unwrap();
    let gs = [1.0f32, -2.0, 0.5, 3.0];
    for r in 0..4 {
        for i in 0..2 {
            let want = gs[r] * w[i];
            assert!((dx[r * 2 + i] - want).abs() <= 1e-6, "{:?}", dx);
        }
    }
}

/// An asymmetric plan (`set_backward_stage_plan`): one forward stage of two linear layers, two
/// backward stages, so the forward keeps the activation between the layers. For h = W1 x + b1,
/// y = W2 h + b2 and dL/dy = g per row: dW2 = sum g h^T, db2 = sum g, dh = W2^T g,
/// dW1 = sum dh x^T, db1 = sum dh, worked out here in f64 from the model's own weights.
#[test]
fn backward_stages_that_differ_from_the_forward_give_the_hand_computed_gradients() {
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cpu, 2).unwrap();
    let mut model = Model::new(
        r#"{"layers":[{"type":"linear","in":2,"out":2},{"type":"linear","in":2,"out":1}]}"#,
        Some(&options),
    )
    .unwrap();
    let e = model.set_backward_stage_plan(&[1, 1]).unwrap_err();
    assert_eq!(e.status(), Status::State, "{}", e.message()); // no explicit forward plan yet
    model.set_stage_plan(&[2]).unwrap();
    model.set_backward_stage_plan(&[1, 1]).unwrap();
    assert_eq!(model.stage_plan().unwrap(), vec![2]);
    assert_eq!(model.backward_stage_plan().unwrap(), vec![1, 1]);

    let read = |model: &mut Model, i: usize| -> Vec<f64> {
        let v: Vec<f32> = model.param_master(i).unwrap().view().to_vec().unwrap();
        v.into_iter().map(f64::from).collect()
    };
    // The output bias enters no gradient.
    let (w1, b1, w2) = (
        read(&mut model, 0),
        read(&mut model, 1),
        read(&mut model, 2),
    );
    let xs = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.5, 0.0, 2.0];
    let gs = [1.0f32, -2.0, 0.5, 3.0];
    let x = Tensor::new(&xs, &[4, 2]).unwrap();
    let g = Tensor::new(&gs, &[4, 1]).unwrap();
    model.forward_train(&[&x], None).unwrap();
    model.backward(&[Some(&g)]).unwrap();

    let (mut dw1, mut db1, mut dw2, mut db2) = ([0.0f64; 4], [0.0f64; 2], [0.0f64; 2], 0.0f64);
    for r in 0..4 {
        let xr = [f64::from(xs[2 * r]), f64::from(xs[2 * r + 1])];
        let gr = f64::from(gs[r]);
        for j in 0..2 {
            let h = b1[j] + w1[2 * j] * xr[0] + w1[2 * j + 1] * xr[1];
            dw2[j] += gr * h;
            let dh = w2[j] * gr;
            db1[j] += dh;
            dw1[2 * j] += dh * xr[0];
            dw1[2 * j + 1] += dh * xr[1];
        }
        db2 += gr;
    }
    let want: [&[f64]; 4] = [&dw1, &db1, &dw2, &[db2]];
    for (i, want) in want.iter().enumerate() {
        let got: Vec<f32> = model.param_grad(i).unwrap().view().to_vec().unwrap();
        for (a, b) in got.iter().zip(want.iter()) {
            assert!(
                (f64::from(*a) - b).abs() <= 1e-5 * b.abs().max(1.0),
                "{i}: {got:?} vs {want:?}"
            );
        }
    }
    // A new forward plan drops the backward one.
    model.set_stage_plan(&[1, 1]).unwrap();
    assert_eq!(model.backward_stage_plan().unwrap(), vec![1, 1]);
    model.set_stage_plan(&[2]).unwrap();
    assert_eq!(model.backward_stage_plan().unwrap(), vec![2]);
}
