//! LoRA adapters through the Rust API: options, queries, training moves only the adapters, and
//! the PEFT-format save / load round trip. The numerics against an independent reference are
//! tested from C (tests/c/test_lora.c) and against PEFT from Python
//! (tests/python/test_lora_native.py).

use roundpipe::{
    DeviceKind, Loss, LossKind, Model, ModelOptions, Optimizer, OptimizerKind, ParamKind, Status,
    Tensor,
};

const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
 "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": false, "initializer_range": 0.1}"#;

fn lora_options(targets: Option<&str>) -> ModelOptions {
    let mut options = ModelOptions::new().unwrap();
    options.set_devices(DeviceKind::Cpu, 2).unwrap();
    options.set_lora(4, 8.0, 0.0, targets).unwrap();
    options
}

fn masters(model: &mut Model) -> Vec<Vec<f32>> {
    model.synchronize().unwrap();
    (0..model.param_count().unwrap())
        .map(|i| {
            model
                .param_master(i)
                .unwrap()
                .view()
                .to_vec::<f32>()
                .unwrap()
        })
        .collect()
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("roundpipe-lora-{}-{}", name, std::process::id()))
}

#[test]
fn only_the_adapters_train_and_they_round_trip_through_peft_files() {
    let mut model =
        Model::from_hf_config(QWEN3, Some(&lora_options(Some("q_proj,down_proj")))).unwrap();
    let lora = model.lora().unwrap().unwrap();
    assert_eq!((lora.rank, lora.alpha, lora.dropout), (4, 8.0, 0.0));
    assert_eq!(lora.target_modules, "q_proj,down_proj");
    let kinds: Vec<ParamKind> = (0..model.param_count().unwrap())
        .map(|i| model.param_kind(i).unwrap())
        .collect();
    for (i, kind) in kinds.iter().enumerate() {
        let name = model.param_hf_name(i).unwrap();
        let adapter = name.contains(".lora_A.") || name.contains(".lora_B.");
        assert_eq!(*kind == ParamKind::Trainable, adapter, "{}", name);
    }
    assert_eq!(
        kinds.iter().filter(|k| **k == ParamKind::Trainable).count(),
        2 * 2 * 2
    );

    let before = masters(&mut model);
    let ids: Vec<i64> = (0..4 * 8).map(|k| (k * 7 % 64) as i64).collect();
    let ids = Tensor::new(&ids, &[4, 8]).unwrap();
    let loss = Loss::new(LossKind::CausalLm).unwrap();
    let mut adamw = Optimizer::new(OptimizerKind::AdamW).unwrap();
    adamw.set_learning_rate(1e-2).unwrap();
    let mut losses = Vec::new();
    for _ in 0..8 {
        losses.push(
            model
                .forward_backward(&[&ids], Some(&ids), Some(&loss), None)
                .unwrap(),
        );
        model.step(&adamw, false).unwrap();
    }
    assert!(losses[7] < losses[0], "loss did not fall: {:?}", losses);
    let after = masters(&mut model);
    for (i, kind) in kinds.iter().enumerate() {
        let changed = before[i] != after[i];
        // B starts at zero, so both A and B move once B has had a step.
        assert_eq!(changed, *kind == ParamKind::Trainable, "parameter {}", i);
    }

    let dir = temp("adapter");
    model.save_lora(&dir, Some("tiny-qwen3")).unwrap();
    assert!(dir.join("adapter_config.json").exists());
    let mut fresh =
        Model::from_hf_config(QWEN3, Some(&lora_options(Some("down_proj,q_proj")))).unwrap();
    fresh.load_lora(&dir).unwrap();
    let loaded = masters(&mut fresh);
    for (i, kind) in kinds.iter().enumerate() {
        if *kind == ParamKind::Trainable {
            assert_eq!(loaded[i], after[i], "adapter {}", i);
        }
    }
    // Adapters of other projections do not fit: refused by name, nothing changed.
    let mut other = Model::from_hf_config(QWEN3, Some(&lora_options(None))).unwrap();
    let e = other.load_lora(&dir).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
    assert!(e.to_string().contains("target_modules"), "{}", e);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn lora_options_are_checked_and_need_a_hugging_face_model() {
    let mut options = ModelOptions::new().unwrap();
    let e = options
        .set_lora(4, 8.0, 0.0, Some("q_proj,embed_tokens"))
        .unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.to_string().contains("embed_tokens"), "{}", e);
    assert_eq!(
        options.set_lora(4, -1.0, 0.0, None).unwrap_err().status(),
        Status::InvalidArgument
    );
    options.set_lora(4, 8.0, 0.0, None).unwrap();
    let spec = r#"{"layers":[{"type":"linear","in":4,"out":2}]}"#;
    let e = Model::new(spec, Some(&options)).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.to_string().contains("linear"), "{}", e);
    let mut plain = Model::from_hf_config(QWEN3, None).unwrap();
    assert_eq!(plain.lora().unwrap(), None);
    let e = plain.save_lora(temp("none"), None).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
}
