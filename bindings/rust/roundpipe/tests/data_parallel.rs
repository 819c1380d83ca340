//! Data parallelism settings and queries without a second process (the two-process training is
//! tested from Python, tests/python/test_data_parallel.py, launched with torchrun).

use std::time::Duration;

use roundpipe::{DeviceKind, Model, ModelOptions, Status};

const SPEC: &str = r#"{"layers":[{"type":"linear","in":4,"out":8},{"type":"tanh"},{"type":"linear","in":8,"out":2}]}"#;

fn options() -> ModelOptions {
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cpu, 1).unwrap();
    options
}

#[test]
fn a_model_without_data_parallelism_is_rank_0_of_1() {
    let model = Model::new(SPEC, Some(&options())).unwrap();
    assert_eq!(model.data_parallel().unwrap(), (0, 1));
    // world size 0 turns it off explicitly
    let mut opts = options();
    opts.set_data_parallel(0, 0, None, Duration::ZERO).unwrap();
    let model = Model::new(SPEC, Some(&opts)).unwrap();
    assert_eq!(model.data_parallel().unwrap(), (0, 1));
}

#[test]
fn settings_out_of_range_are_invalid_arguments() {
    let mut opts = options();
    let e = opts
        .set_data_parallel(0, -2, None, Duration::from_secs(1))
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let e = opts
        .set_data_parallel(2, 2, Some("env://"), Duration::from_secs(1))
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    let e = opts
        .set_data_parallel(0, 1, Some("tcp://a\0b:1"), Duration::from_secs(1))
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    opts.set_global_loss(true)
        .unwrap()
        .set_global_loss(false)
        .unwrap();
}

#[test]
fn a_world_of_one_joins_alone() {
    if !roundpipe::data_parallel_available().unwrap() {
        eprintln!("skipped: libroundpipe was built without c10d's Gloo support");
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut opts = options();
    opts.set_data_parallel(
        0,
        1,
        Some(&format!("tcp://127.0.0.1:{}", port)),
        Duration::from_secs(30),
    )
    .unwrap()
    .set_global_loss(true)
    .unwrap();
    let model = Model::new(SPEC, Some(&opts)).unwrap();
    assert_eq!(model.data_parallel().unwrap(), (0, 1));
}
