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
