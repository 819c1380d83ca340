//! The progress callback (its own test binary: the sink is process-wide).

use std::sync::{Arc, Mutex};

use roundpipe::{DeviceKind, Model, ModelOptions};

#[test]
fn saving_and_loading_weights_report_progress_ending_at_the_total() {
    let seen: Arc<Mutex<Vec<(String, i64, i64)>>> = Arc::default();
    let sink = Arc::clone(&seen);
    roundpipe::set_progress_callback(move |what, done, total| {
        sink.lock().unwrap().push((what.to_string(), done, total));
    })
    .unwrap();
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cpu, 1).unwrap();
    // 8 x 4 weights and 4 biases, fp32: 144 bytes of tensor data.
    let mut model = Model::new(
        r#"{"layers":[{"type":"linear","in":8,"out":4}]}"#,
        Some(&options),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("roundpipe-progress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.safetensors");
    model.save(&path).unwrap();
    model.load(&path).unwrap();
    roundpipe::reset_progress_callback().unwrap();
    model.save(&path).unwrap(); // no longer reported
    std::fs::remove_dir_all(&dir).unwrap();

    let seen = seen.lock().unwrap();
    let p = path.display().to_string();
    for verb in ["save", "load"] {
        let calls: Vec<_> = seen
            .iter()
            .filter(|c| c.0 == format!("{} {}", verb, p))
            .collect();
        assert!(calls.len() >= 2, "{:?}", *seen);
        assert!(calls.iter().all(|c| c.2 == 144), "{:?}", calls);
        assert_eq!(calls[0].1, 0);
        assert_eq!(calls.last().unwrap().1, 144);
        assert_eq!(
            calls.iter().filter(|c| c.1 == c.2).count(),
            1,
            "{:?}",
            calls
        );
    }
    // Only these two operations were reported: not the save after the reset.
    assert_eq!(
        seen.len(),
        seen.iter().filter(|c| c.0.ends_with(&p)).count()
    );
    assert_eq!(seen.iter().filter(|c| c.1 == c.2).count(), 2);

    // A closure that panics: the panic stays in Rust and the save succeeds.
    roundpipe::set_progress_callback(|_, _, _| panic!("progress sink panicked")).unwrap();
    let dir2 = std::env::temp_dir().join(format!("roundpipe-progress2-{}", std::process::id()));
    std::fs::create_dir_all(&dir2).unwrap();
    model.save(dir2.join("w.safetensors")).unwrap();
    std::fs::remove_dir_all(&dir2).unwrap();
    roundpipe::reset_progress_callback().unwrap();
}
