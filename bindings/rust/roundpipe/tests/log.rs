//! The log callback (its own test binary: the sink is process-wide).

use std::sync::{Arc, Mutex};

use roundpipe::{DeviceKind, LogLevel, Model, ModelOptions};

#[test]
fn log_messages_reach_a_rust_closure_and_panics_stay_in_rust() {
    let seen: Arc<Mutex<Vec<(LogLevel, String)>>> = Arc::default();
    let sink = Arc::clone(&seen);
    roundpipe::set_log_callback(
        move |level, msg| {
            sink.lock().unwrap().push((level, msg.to_string()));
            if msg.contains("no message contains this") {
                unreachable!();
            }
        },
        LogLevel::Debug,
    )
    .unwrap();
    let mut options = ModelOptions::new().unwrap();
    options
        .set_devices(DeviceKind::Cpu, 2)
        .unwrap()
        .set_name("log-test")
        .unwrap();
    let model = Model::new(
        r#"{"layers":[{"type":"linear","in":4,"out":2}]}"#,
        Some(&options),
    )
    .unwrap();
    drop(model);
    for (_, msg) in seen.lock().unwrap().iter() {
        assert!(!msg.is_empty());
    }

    // A closure that panics on every message: the panic is caught in the trampoline.
    roundpipe::set_log_callback(|_, _| panic!("log sink panicked"), LogLevel::Debug).unwrap();
    let model = Model::new(
        r#"{"layers":[{"type":"linear","in":4,"out":2}]}"#,
        Some(&options),
    )
    .unwrap();
    drop(model);

    roundpipe::reset_log_callback().unwrap();
}
