//! Error paths: every failure is an `Err` with the library's code and message, and the objects
//! stay usable afterwards.

use roundpipe::{
    DeviceKind, Loss, LossKind, Model, ModelOptions, Optimizer, OptimizerKind, RunConfig, Status,
    Tensor,
};

const SPEC: &str = r#"{"layers":[{"type":"linear","in":4,"out":2}]}"#;

fn small_model() -> Model {
    let mut options = ModelOptions::new().unwrap();
    options
        .set_seed(5)
        .unwrap()
        .set_devices(DeviceKind::Cpu, 1)
        .unwrap();
    Model::new(SPEC, Some(&options)).unwrap()
}

fn assert_invalid(e: roundpipe::Error, needle: &str) {
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
    assert_eq!(e.code(), -1);
    assert!(
        e.message().contains(needle),
        "message {:?} should mention {:?}",
        e.message(),
        needle
    );
}

#[test]
fn malformed_json_spec_is_an_invalid_argument() {
    let e = Model::new(r#"{"layers": [ {"type": "linear", "#, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(e.code(), roundpipe::sys::RP_ERR_INVALID_ARGUMENT);
    assert!(!e.message().is_empty());
    // Display carries the library's status name, the code and the message.
    let shown = e.to_string();
    assert!(
        shown.contains("(-1)") && shown.contains(e.message()),
        "{}",
        shown
    );
}

#[test]
fn bad_layer_arguments_name_the_layer() {
    let e = Model::new(
        r#"{"layers":[{"type":"gelu"},{"type":"linear","in":-3,"out":2}]}"#,
        None,
    )
    .unwrap_err();
    assert_invalid(e, "layer 1 (linear)");
}

#[test]
fn unknown_layer_type_and_unknown_keys_are_rejected() {
    let e = Model::new(r#"{"layers":[{"type":"no_such_layer"}]}"#, None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let e = Model::new(
        r#"{"layers":[{"type":"linear","in":4,"out":2,"bais":false}]}"#,
        None,
    )
    .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
}

#[test]
fn nul_byte_in_spec_is_refused_by_the_binding() {
    let e = Model::new("{\"layers\":[]}\0", None).unwrap_err();
    assert_invalid(e, "NUL");
}

#[test]
fn bad_option_values_are_rejected() {
    let mut config = RunConfig::new().unwrap();
    assert_eq!(
        config.set_num_microbatch(-1).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(
        config.set_num_microbatch(100_000).unwrap_err().status(),
        Status::InvalidArgument
    );
    config.set_num_microbatch(2).unwrap(); // still usable
    let mut options = ModelOptions::new().unwrap();
    assert_eq!(
        options
            .set_devices(DeviceKind::Cpu, -1)
            .unwrap_err()
            .status(),
        Status::InvalidArgument
    );
    assert_eq!(
        options
            .set_devices(DeviceKind::Cpu, 65)
            .unwrap_err()
            .status(),
        Status::InvalidArgument
    );
    let mut sgd = Optimizer::new(OptimizerKind::Sgd).unwrap();
    assert_eq!(
        sgd.set_betas(0.9, 0.99).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(
        sgd.set_learning_rate(f64::NAN).unwrap_err().status(),
        Status::InvalidArgument
    );
    let mut adamw = Optimizer::new(OptimizerKind::AdamW).unwrap();
    assert_eq!(
        adamw.set_momentum(0.9).unwrap_err().status(),
        Status::InvalidArgument
    );
    let mut loss = Loss::new(LossKind::Mse).unwrap();
    assert_eq!(
        loss.set_scale(f64::INFINITY).unwrap_err().status(),
        Status::InvalidArgument
    );
}

#[test]
fn cuda_devices_without_a_gpu_fail_with_cuda_status() {
    if roundpipe::cuda_device_count().unwrap() > 0 {
        return; // a GPU is visible: nothing to check here
    }
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cuda, 1).unwrap();
    let e = Model::new(SPEC, Some(&options)).unwrap_err();
    assert_eq!(e.status(), Status::Cuda, "{}", e);
}

#[test]
fn wrong_input_shape_and_dtype_are_rejected_and_the_model_survives() {
    let mut model = small_model();
    let loss = Loss::new(LossKind::Mse).unwrap();
    let labels = Tensor::new(&[0f32; 6 * 2], &[6, 2]).unwrap();

    let wrong_width = Tensor::new(&[0f32; 6 * 5], &[6, 5]).unwrap();
    let e = model
        .forward_backward(&[&wrong_width], Some(&labels), Some(&loss), None)
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);

    let wrong_dtype = Tensor::new(&[0i64; 6 * 4], &[6, 4]).unwrap();
    let e = model.forward(&[&wrong_dtype], None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);

    let no_inputs: [&dyn roundpipe::AsDlpack; 0] = [];
    assert!(model.forward(&no_inputs, None).is_err());

    let good = Tensor::new(&[0.25f32; 6 * 4], &[6, 4]).unwrap();
    let value = model
        .forward_backward(&[&good], Some(&labels), Some(&loss), None)
        .unwrap();
    assert!(value.is_finite());
    assert_eq!(model.forward(&[&good], None).unwrap()[0].shape(), &[6, 2]);
}

#[test]
fn optimizer_of_another_kind_is_a_state_error() {
    let mut model = small_model();
    let x = Tensor::new(&[0.5f32; 6 * 4], &[6, 4]).unwrap();
    let y = Tensor::new(&[0f32; 6 * 2], &[6, 2]).unwrap();
    let loss = Loss::new(LossKind::Mse).unwrap();
    model
        .forward_backward(&[&x], Some(&y), Some(&loss), None)
        .unwrap();
    model.step(&Optimizer::adamw(1e-3).unwrap(), false).unwrap();
    model
        .forward_backward(&[&x], Some(&y), Some(&loss), None)
        .unwrap();
    let e = model
        .step(&Optimizer::sgd(1e-3).unwrap(), false)
        .unwrap_err();
    assert_eq!(e.status(), Status::State, "{}", e);
    model.step(&Optimizer::adamw(1e-3).unwrap(), false).unwrap();
}

#[test]
fn missing_weights_file_is_an_io_error_naming_the_path() {
    let mut model = small_model();
    let path = std::env::temp_dir().join("roundpipe-no-such-dir/weights.safetensors");
    let e = model.load(&path).unwrap_err();
    assert_eq!(e.status(), Status::Io, "{}", e);
    assert!(e.message().contains("weights.safetensors"), "{}", e);
}

#[test]
fn parameter_lookups_out_of_range_fail() {
    let mut model = small_model();
    let n = model.param_count().unwrap();
    assert_eq!(n, 2);
    assert_eq!(
        model.param_name(n).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(
        model.param_master(n).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(
        model.param_find("9.weight").unwrap_err().status(),
        Status::InvalidArgument
    );
}

#[test]
fn tensor_construction_checks_sizes_and_types() {
    assert_eq!(
        Tensor::new(&[1f32, 2.0, 3.0], &[2, 2])
            .unwrap_err()
            .status(),
        Status::InvalidArgument
    );
    assert_eq!(
        Tensor::new(&[1f32], &[-1]).unwrap_err().status(),
        Status::InvalidArgument
    );
    let t = Tensor::new(&[1i64, 2, 3], &[3]).unwrap();
    assert!(t.as_slice::<f32>().is_err());
    assert_eq!(t.as_slice::<i64>().unwrap(), &[1, 2, 3]);
    assert_eq!(Tensor::scalar(2.5f64).shape(), &[] as &[i64]);
}

#[test]
fn versions_and_status_names() {
    assert_eq!(roundpipe::abi_version(), roundpipe::ABI_VERSION);
    let v = roundpipe::version();
    assert_eq!(v.split('.').count(), 3, "{}", v);
    assert_eq!(Status::from_code(0), None);
    assert_eq!(Status::from_code(-3), Some(Status::Io));
    assert!(!Status::InvalidArgument.name().is_empty());
}

#[test]
fn handles_are_send() {
    fn is_send<T: Send>() {}
    is_send::<Model>();
    is_send::<RunConfig>();
    is_send::<ModelOptions>();
    is_send::<Optimizer>();
    is_send::<Loss>();
    is_send::<roundpipe::DlTensor>();
    // A model moved to another thread is driven there.
    let model = small_model();
    let n = std::thread::spawn(move || model.param_count().unwrap())
        .join()
        .unwrap();
    assert_eq!(n, 2);
}
