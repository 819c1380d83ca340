//! A layer from Rust closures, trained in a model with a built-in linear layer on 2 CPU worker
//! devices, against values computed here by hand (f64).
//!
//! The model, x [6, 4] in 3 microbatches of 2 rows, built-in MSE summed over microbatches:
//!   0 "rust:affine"  y = x * w * s + b   (w, b [4] trainable, s [4] frozen; buffer "seen"
//!                                          [1] counts the training microbatches it saw in its
//!                                          non-recompute forward)
//!   1 linear 4 -> 2
//! One layer per stage: the closure layer is a forward stage (Forward, then Recompute and
//! backward), the linear layer the tail.
//!
//! Tolerance: f32 in the engine against f64 here, through two layers of 4-term sums of values
//! of order 1: a few f32 roundings (~1e-7 relative); 1e-5 still catches any wrong term.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use roundpipe::{
    DeviceKind, LayerDef, LayerGrads, LayerOutput, Loss, LossKind, Model, ModelOptions, Optimizer,
    ParamKind, Phase, RunConfig, Status, Tensor,
};

const N: usize = 6;
const D: usize = 4;
const O: usize = 2;
const M: usize = 3;
const TOL: f64 = 1e-5;

const SPEC: &str = r#"{"layers": [{"type": "caller", "def": 0},
                                  {"type": "linear", "in": 4, "out": 2}]}"#;

fn data(seed: u64, n: usize) -> Vec<f32> {
    // A 64-bit LCG: exact, portable values in [-1, 1).
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 40) as f32 / 8388608.0 - 1.0
        })
        .collect()
}

const W0: [f32; D] = [0.9, 1.1, 0.7, 1.3];
const B0: [f32; D] = [0.1, -0.2, 0.3, -0.4];
const S0: [f32; D] = [1.5, 0.5, 1.0, 2.0];

/// What the closures saw, shared with the test.
#[derive(Default)]
struct Seen {
    phases: [AtomicUsize; 3],
    backward: AtomicUsize,
    contexts_dropped: AtomicUsize,
    fail_forward: AtomicBool,
}

/// The context: dropping it is the engine's release; counted.
struct Saved {
    x: Vec<f32>,
    w: Vec<f32>,
    s: Vec<f32>,
    shape: Vec<i64>,
    seen: Arc<Seen>,
}

impl Drop for Saved {
    fn drop(&mut self) {
        self.seen.contexts_dropped.fetch_add(1, Ordering::SeqCst);
    }
}

fn affine_layer(seen: Arc<Seen>) -> LayerDef {
    let fseen = Arc::clone(&seen);
    let bseen = Arc::clone(&seen);
    let mut def = LayerDef::new(
        "rust:affine",
        move |call, inputs| {
            let slot = match call.phase() {
                Phase::Forward => 0,
                Phase::Recompute => 1,
                Phase::Tail => 2,
            };
            fseen.phases[slot].fetch_add(1, Ordering::SeqCst);
            if fseen.fail_forward.load(Ordering::SeqCst) {
                return Err("deliberate failure".to_string());
            }
            let params = call.params();
            let e = |e: roundpipe::Error| e.to_string();
            let x = inputs[0].as_slice::<f32>().map_err(e)?;
            let (w, b, s) = (
                params[0].as_slice::<f32>().map_err(e)?,
                params[1].as_slice::<f32>().map_err(e)?,
                params[2].as_slice::<f32>().map_err(e)?,
            );
            let y: Vec<f32> = (0..x.len())
                .map(|i| x[i] * w[i % D] * s[i % D] + b[i % D])
                .collect();
            let out = Tensor::new(&y, inputs[0].shape()).map_err(e)?;
            if call.phase() != Phase::Recompute && call.training() {
                call.buffer_mut::<f32>(0).map_err(e)?[0] += 1.0;
            }
            if call.phase() == Phase::Forward {
                return Ok(LayerOutput::new(vec![out])); // no gradient wanted: keep nothing
            }
            Ok(LayerOutput::new(vec![out]).with_context(Saved {
                x: x.to_vec(),
                w: w.to_vec(),
                s: s.to_vec(),
                shape: inputs[0].shape().to_vec(),
                seen: Arc::clone(&fseen),
            }))
        },
        Some(
            move |_call: &mut roundpipe::LayerCall<'_>,
                  ctx: &mut roundpipe::Context,
                  grads: &[Option<roundpipe::TensorView<'_>>]| {
                bseen.backward.fetch_add(1, Ordering::SeqCst);
                let c = ctx
                    .downcast_ref::<Saved>()
                    .ok_or_else(|| "not my context".to_string())?;
                let g = grads[0]
                    .as_ref()
                    .ok_or_else(|| "no output gradient".to_string())?
                    .as_slice::<f32>()
                    .map_err(|e| e.to_string())?;
                let mut dx = vec![0f32; g.len()];
                let (mut dw, mut db) = (vec![0f32; D], vec![0f32; D]);
                for i in 0..g.len() {
                    let j = i % D;
                    dx[i] = g[i] * c.w[j] * c.s[j];
                    dw[j] += g[i] * c.x[i] * c.s[j];
                    db[j] += g[i];
                }
                let t = |v: &[f32], shape: &[i64]| Tensor::new(v, shape).map_err(|e| e.to_string());
                Ok(LayerGrads {
                    inputs: vec![Some(t(&dx, &c.shape)?)],
                    // s is frozen: no gradient.
                    params: vec![Some(t(&dw, &[D as i64])?), Some(t(&db, &[D as i64])?), None],
                })
            },
        ),
    )
    .unwrap();
    let v = |a: &[f32]| Tensor::new(a, &[D as i64]).unwrap();
    def.add_param("w", &v(&W0), true).unwrap();
    def.add_param("b", &v(&B0), true).unwrap();
    def.add_param("s", &v(&S0), false).unwrap();
    def.add_buffer("seen", &Tensor::new(&[0f32], &[1]).unwrap())
        .unwrap();
    def
}

fn build(seen: Arc<Seen>) -> Model {
    let mut config = RunConfig::new().unwrap();
    config.set_num_microbatch(M as i32).unwrap();
    let mut options = ModelOptions::new().unwrap();
    options
        .set_seed(5)
        .unwrap()
        .set_devices(DeviceKind::Cpu, 2)
        .unwrap()
        .set_stage_plan(&[1, 1])
        .unwrap()
        .set_run_config(Some(&config))
        .unwrap();
    Model::with_layers(SPEC, vec![affine_layer(seen)], Some(&options)).unwrap()
}

fn read(model: &mut Model, name: &str, grad: bool) -> Vec<f32> {
    let i = model.param_find(name).unwrap();
    let t = if grad {
        model.param_grad(i).unwrap()
    } else {
        model.param_master(i).unwrap()
    };
    t.to_vec::<f32>().unwrap()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += (*g as f64 - w).powi(2);
        den += w * w;
    }
    assert_eq!(got.len(), want.len(), "{}", what);
    let err = num.sqrt() / den.sqrt().max(1e-6);
    assert!(
        err <= TOL,
        "{}: relative error {:e}, got {:?}, want {:?}",
        what,
        err,
        got,
        want
    );
}

/// Loss and gradients of one call, by hand: (loss, dw, db, dW, dc).
fn reference(
    x: &[f32],
    t: &[f32],
    w: &[f64],
    b: &[f64],
    lw: &[f64],
    lb: &[f64],
) -> (f64, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = N / M;
    let (mut loss, mut dw, mut db) = (0.0, vec![0.0; D], vec![0.0; D]);
    let (mut dlw, mut dlb) = (vec![0.0; O * D], vec![0.0; O]);
    for r in 0..N {
        let h: Vec<f64> = (0..D)
            .map(|j| x[r * D + j] as f64 * w[j] * S0[j] as f64 + b[j])
            .collect();
        let mut gh = vec![0.0; D];
        for o in 0..O {
            let y = lb[o] + (0..D).map(|j| h[j] * lw[o * D + j]).sum::<f64>();
            let d = y - t[r * O + o] as f64;
            // MSE of a microbatch: the mean over its rows * O elements.
            loss += d * d / (rows * O) as f64;
            let gy = 2.0 * d / (rows * O) as f64;
            dlb[o] += gy;
            for j in 0..D {
                dlw[o * D + j] += gy * h[j];
                gh[j] += gy * lw[o * D + j];
            }
        }
        for j in 0..D {
            dw[j] += gh[j] * x[r * D + j] as f64 * S0[j] as f64;
            db[j] += gh[j];
        }
    }
    (loss, dw, db, dlw, dlb)
}

fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&a| a as f64).collect()
}

#[test]
fn closure_layer_trains_like_the_hand_computed_reference() {
    let seen = Arc::new(Seen::default());
    let mut model = build(Arc::clone(&seen));
    assert_eq!(model.stage_plan().unwrap(), vec![1, 1]);
    let x = data(11, N * D);
    let t = data(12, N * O);
    let xt = Tensor::new(&x, &[N as i64, D as i64]).unwrap();
    let tt = Tensor::new(&t, &[N as i64, O as i64]).unwrap();
    let mse = Loss::new(LossKind::Mse).unwrap();

    // The linear layer's initial weights are inputs of the reference.
    model.synchronize().unwrap();
    let lw = to_f64(&read(&mut model, "1.weight", false));
    let lb = to_f64(&read(&mut model, "1.bias", false));
    let (w, b) = (to_f64(&W0), to_f64(&B0));
    let (want_loss, dw, db, dlw, dlb) = reference(&x, &t, &w, &b, &lw, &lb);

    let loss = model
        .forward_backward(&[&xt], Some(&tt), Some(&mse), None)
        .unwrap();
    assert!(
        (loss - want_loss).abs() <= TOL * want_loss.abs(),
        "{} vs {}",
        loss,
        want_loss
    );
    model.synchronize().unwrap();
    assert_close(&read(&mut model, "0.w", true), &dw, "gradient of 0.w");
    assert_close(&read(&mut model, "0.b", true), &db, "gradient of 0.b");
    assert_close(
        &read(&mut model, "1.weight", true),
        &dlw,
        "gradient of 1.weight",
    );
    assert_close(
        &read(&mut model, "1.bias", true),
        &dlb,
        "gradient of 1.bias",
    );

    // Phases: a forward stage runs Forward, then Recompute and backward, once per microbatch;
    // every context kept was dropped (released) once.
    assert_eq!(seen.phases[0].load(Ordering::SeqCst), M);
    assert_eq!(seen.phases[1].load(Ordering::SeqCst), M);
    assert_eq!(seen.phases[2].load(Ordering::SeqCst), 0);
    assert_eq!(seen.backward.load(Ordering::SeqCst), M);
    assert_eq!(seen.contexts_dropped.load(Ordering::SeqCst), M);
    assert_eq!(read(&mut model, "0.seen", false), vec![M as f32]);

    // The frozen parameter: its kind, no gradient, and unchanged by a step.
    let s = model.param_find("0.s").unwrap();
    assert_eq!(model.param_kind(s).unwrap(), ParamKind::Frozen);
    assert_eq!(
        model
            .param_kind(model.param_find("0.seen").unwrap())
            .unwrap(),
        ParamKind::Buffer
    );
    assert_eq!(model.param_kind(0).unwrap(), ParamKind::Trainable);
    assert!(model.param_grad(s).is_err());

    let lr = 0.1;
    model.step(&Optimizer::sgd(lr).unwrap(), false).unwrap();
    model.synchronize().unwrap();
    let w1: Vec<f64> = (0..D).map(|j| w[j] - lr * dw[j]).collect();
    let lw1: Vec<f64> = (0..O * D).map(|k| lw[k] - lr * dlw[k]).collect();
    assert_close(
        &read(&mut model, "0.w", false),
        &w1,
        "0.w after one SGD step",
    );
    assert_close(
        &read(&mut model, "1.weight", false),
        &lw1,
        "1.weight after one SGD step",
    );
    assert_eq!(
        read(&mut model, "0.s", false),
        S0.to_vec(),
        "the frozen s moved"
    );
}

#[test]
fn a_failing_closure_fails_the_call_with_its_message() {
    let seen = Arc::new(Seen::default());
    let mut model = build(Arc::clone(&seen));
    let xt = Tensor::new(&data(11, N * D), &[N as i64, D as i64]).unwrap();
    let tt = Tensor::new(&data(12, N * O), &[N as i64, O as i64]).unwrap();
    let mse = Loss::new(LossKind::Mse).unwrap();
    seen.fail_forward.store(true, Ordering::SeqCst);
    let err = model
        .forward_backward(&[&xt], Some(&tt), Some(&mse), None)
        .unwrap_err();
    assert_eq!(err.status(), Status::Callback);
    assert!(err.message().contains("rust:affine"), "{}", err);
    assert!(err.message().contains("deliberate failure"), "{}", err);
    // Still usable afterwards.
    seen.fail_forward.store(false, Ordering::SeqCst);
    let loss = model
        .forward_backward(&[&xt], Some(&tt), Some(&mse), None)
        .unwrap();
    assert!(loss.is_finite());
    drop(model);
    // Every context the closures kept was released.
    assert_eq!(
        seen.contexts_dropped.load(Ordering::SeqCst),
        seen.phases[1].load(Ordering::SeqCst) + seen.phases[2].load(Ordering::SeqCst)
    );
}

#[test]
fn closure_layer_as_the_tail_stage() {
    // linear 4 -> 4, then the closure layer: it runs in the fused tail (Tail, then backward).
    let spec = r#"{"layers": [{"type": "linear", "in": 4, "out": 4},
                              {"type": "caller", "def": 0}]}"#;
    let seen = Arc::new(Seen::default());
    let mut config = RunConfig::new().unwrap();
    config.set_num_microbatch(M as i32).unwrap();
    let mut options = ModelOptions::new().unwrap();
    options
        .set_devices(DeviceKind::Cpu, 2)
        .unwrap()
        .set_stage_plan(&[1, 1])
        .unwrap()
        .set_run_config(Some(&config))
        .unwrap();
    let mut model =
        Model::with_layers(spec, vec![affine_layer(Arc::clone(&seen))], Some(&options)).unwrap();
    let x = data(21, N * D);
    let t = data(22, N * D);
    model.synchronize().unwrap();
    let lw = to_f64(&read(&mut model, "0.weight", false));
    let lb = to_f64(&read(&mut model, "0.bias", false));

    // By hand: h = x W^T + c, y = h w s + b; MSE of each microbatch (2 rows x 4), summed.
    let per_mb = ((N / M) * D) as f64;
    let (mut want_loss, mut dw) = (0.0, vec![0.0; D]);
    for r in 0..N {
        for j in 0..D {
            let h = lb[j]
                + (0..D)
                    .map(|k| x[r * D + k] as f64 * lw[j * D + k])
                    .sum::<f64>();
            let y = h * W0[j] as f64 * S0[j] as f64 + B0[j] as f64;
            let d = y - t[r * D + j] as f64;
            want_loss += d * d / per_mb;
            dw[j] += 2.0 * d / per_mb * h * S0[j] as f64;
        }
    }
    let xt = Tensor::new(&x, &[N as i64, D as i64]).unwrap();
    let tt = Tensor::new(&t, &[N as i64, D as i64]).unwrap();
    let loss = model
        .forward_backward(
            &[&xt],
            Some(&tt),
            Some(&Loss::new(LossKind::Mse).unwrap()),
            None,
        )
        .unwrap();
    assert!(
        (loss - want_loss).abs() <= TOL * want_loss.abs(),
        "{} vs {}",
        loss,
        want_loss
    );
    model.synchronize().unwrap();
    assert_close(
        &read(&mut model, "1.w", true),
        &dw,
        "gradient of 1.w (tail)",
    );
    assert_eq!(seen.phases[0].load(Ordering::SeqCst), 0);
    assert_eq!(seen.phases[1].load(Ordering::SeqCst), 0);
    assert_eq!(seen.phases[2].load(Ordering::SeqCst), M);
    assert_eq!(seen.backward.load(Ordering::SeqCst), M);
    assert_eq!(seen.contexts_dropped.load(Ordering::SeqCst), M);
    // The tail is a non-recompute forward: it updates the buffer once per microbatch.
    assert_eq!(read(&mut model, "1.seen", false), vec![M as f32]);
}
