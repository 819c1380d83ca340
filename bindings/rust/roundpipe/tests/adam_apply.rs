//! `adam_apply` (rp_adam_apply) against torch.optim.Adam's update written out here in double
//! precision, and its refusals, which must leave every tensor as it was.
//!
//! Tolerance: the weights and moments are float32, so each of the three steps rounds them
//! (relative 6e-8); the weights are checked to 1e-6 relative (norm) against the reference.

use roundpipe::{adam_apply, AdamEntry, AdamHyper, Status, Tensor};

fn values(n: usize, seed: u64) -> Vec<f32> {
    // A small LCG: deterministic values in [-1, 1).
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn reference(w: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f32], t: i64, h: &AdamHyper) {
    let bc1 = 1.0 - h.beta1.powi(t as i32);
    let bc2 = 1.0 - h.beta2.powi(t as i32);
    for j in 0..w.len() {
        let mut gr = g[j] as f64;
        if h.decoupled_weight_decay {
            w[j] *= 1.0 - h.lr * h.weight_decay;
        } else {
            gr += h.weight_decay * w[j];
        }
        m[j] = h.beta1 * m[j] + (1.0 - h.beta1) * gr;
        v[j] = h.beta2 * v[j] + (1.0 - h.beta2) * gr * gr;
        w[j] -= h.lr / bc1 * m[j] / (v[j].sqrt() / bc2.sqrt() + h.eps);
    }
}

fn matches_reference(decoupled: bool) {
    let sizes = [3usize, 40_000];
    let h = AdamHyper {
        lr: 1e-2,
        beta1: 0.8,
        beta2: 0.95,
        eps: 1e-6,
        weight_decay: 0.1,
        decoupled_weight_decay: decoupled,
    };
    let mut params: Vec<Tensor> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| Tensor::new(&values(n, 10 + i as u64), &[n as i64]).unwrap())
        .collect();
    let mut ms: Vec<Tensor> = sizes
        .iter()
        .map(|&n| Tensor::new(&vec![0f32; n], &[n as i64]).unwrap())
        .collect();
    let mut vs = ms.clone();
    let mut w: Vec<Vec<f64>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| values(n, 10 + i as u64).iter().map(|&x| x as f64).collect())
        .collect();
    let mut rm: Vec<Vec<f64>> = sizes.iter().map(|&n| vec![0.0; n]).collect();
    let mut rv = rm.clone();
    for step in 1..=3i64 {
        let grads: Vec<Tensor> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                Tensor::new(&values(n, 100 * step as u64 + i as u64), &[n as i64]).unwrap()
            })
            .collect();
        for i in 0..sizes.len() {
            reference(
                &mut w[i],
                &mut rm[i],
                &mut rv[i],
                grads[i].as_slice::<f32>().unwrap(),
                step,
                &h,
            );
        }
        let mut entries: Vec<AdamEntry<'_>> = params
            .iter_mut()
            .zip(grads.iter())
            .zip(ms.iter_mut().zip(vs.iter_mut()))
            .map(|((param, grad), (exp_avg, exp_avg_sq))| AdamEntry {
                param,
                grad,
                exp_avg,
                exp_avg_sq,
                step,
            })
            .collect();
        adam_apply(&mut entries, &h).unwrap();
    }
    for (i, p) in params.iter().enumerate() {
        let got = p.as_slice::<f32>().unwrap();
        let (mut d, mut n) = (0.0f64, 0.0f64);
        for j in 0..got.len() {
            d += (got[j] as f64 - w[i][j]).powi(2);
            n += w[i][j].powi(2);
        }
        assert!(
            d.sqrt() <= 1e-6 * n.sqrt().max(1e-6),
            "entry {}: error {}",
            i,
            d.sqrt() / n.sqrt()
        );
    }
}

#[test]
fn adamw_update_matches_torch_adamw_formula() {
    matches_reference(true);
}

#[test]
fn adam_l2_update_matches_torch_adam_formula() {
    matches_reference(false);
}

#[test]
fn refused_update_changes_nothing() {
    let mut p = Tensor::new(&[1f32, 2.0, 3.0], &[3]).unwrap();
    let g = Tensor::new(&[1f32, 1.0], &[2]).unwrap(); // wrong shape
    let mut m = Tensor::new(&[0f32; 3], &[3]).unwrap();
    let mut v = m.clone();
    let before = (p.clone(), m.clone());
    let mut entries = [AdamEntry {
        param: &mut p,
        grad: &g,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
        step: 1,
    }];
    let e = adam_apply(&mut entries, &AdamHyper::default()).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("grad 0"), "{}", e.message());
    let g3 = Tensor::new(&[1f32, 1.0, 1.0], &[3]).unwrap();
    let mut entries = [AdamEntry {
        param: &mut p,
        grad: &g3,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
        step: 0,
    }];
    let e = adam_apply(&mut entries, &AdamHyper::default()).unwrap_err();
    assert!(e.message().contains("step 0"), "{}", e.message());
    let bad = AdamHyper {
        beta1: 1.5,
        ..AdamHyper::default()
    };
    let mut entries = [AdamEntry {
        param: &mut p,
        grad: &g3,
        exp_avg: &mut m,
        exp_avg_sq: &mut v,
        step: 1,
    }];
    let e = adam_apply(&mut entries, &bad).unwrap_err();
    assert!(e.message().contains("beta1"), "{}", e.message());
    assert_eq!((p, m), before);
    adam_apply(&mut [], &AdamHyper::default()).unwrap(); // nothing to do
}
