//! What several integration tests share: a small MLP in a chosen host memory mode on 2 CPU
//! devices, and a batch with a smooth target of its inputs (no random numbers needed).

use roundpipe::{DeviceKind, FloatType, HostMemoryMode, Model, ModelOptions, Tensor};

pub const SPEC: &str = r#"{"layers":[{"type":"linear","in":8,"out":16},{"type":"gelu"},
                                 {"type":"linear","in":16,"out":1}]}"#;
pub const ROWS: usize = 24;

/// The MLP of `SPEC`, seed 3, on 2 CPU worker devices.
pub fn mlp(mode: HostMemoryMode, dtype: FloatType) -> Model {
    let mut options = ModelOptions::new().unwrap();
    options
        .set_seed(3)
        .unwrap()
        .set_devices(DeviceKind::Cpu, 2)
        .unwrap()
        .set_model_dtype(dtype)
        .unwrap()
        .set_host_memory_mode(mode)
        .unwrap();
    Model::new(SPEC, Some(&options)).unwrap()
}

/// `ROWS` rows of 8 inputs (shifted by `shift`, so each shift is another batch) and a smooth
/// target of them.
pub fn batch(shift: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..ROWS * 8)
        .map(|i| (((i + shift) * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let y: Vec<f32> = (0..ROWS)
        .map(|r| (x[r * 8] - 0.5 * x[r * 8 + 3] + 0.25 * x[r * 8 + 7]).tanh())
        .collect();
    (
        Tensor::new(&x, &[ROWS as i64, 8]).unwrap(),
        Tensor::new(&y, &[ROWS as i64, 1]).unwrap(),
    )
}
