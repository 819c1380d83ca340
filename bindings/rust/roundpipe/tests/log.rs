//! The log callback (its own test binary: the sink is process-wide).

use std::sync::{Arc, Mutex};

use roundpipe::{DeviceKind, LogLevel, Model, ModelOptions};

// The sink is process-wide and the tests of this binary run on parallel threads: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn log_messages_reach_a_rust_closure_and_panics_stay_in_rust() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
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

/// Replacing or resetting the callback frees the previous closure: what it captured is dropped
/// (the library returns from rp_set_log_callback once no call to the old sink is in flight).
#[test]
fn replaced_log_closures_are_freed() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // A sink that holds a reference to `probe` for as long as the library keeps it.
    let install = |probe: &Arc<()>, level| {
        let held = Arc::clone(probe);
        roundpipe::set_log_callback(
            move |_, _| {
                let _ = &held;
            },
            level,
        )
        .unwrap();
    };
    let probe = Arc::new(());
    install(&probe, LogLevel::Debug);
    assert_eq!(Arc::strong_count(&probe), 2);
    install(&probe, LogLevel::Warn);
    assert_eq!(
        Arc::strong_count(&probe),
        2,
        "the first closure was not freed"
    );
    roundpipe::reset_log_callback().unwrap();
    assert_eq!(
        Arc::strong_count(&probe),
        1,
        "the second closure was not freed"
    );
}
