//! What the engine decided, asked rather than re-derived: the stage plan, the resolved run
//! configuration, Hugging Face parameter names and the microbatch split. Each is checked against
//! an expectation stated independently (the header's documented defaults, an explicit plan, the
//! transformers tensor names written out by hand, torch.tensor_split's sizes worked out by hand).

use roundpipe::{
    split_microbatches, Device, DeviceKind, Model, ModelOptions, RecomputeGrain, RunConfig, Split,
    Status, Tensor,
};

/// Four layers: linear, gelu, residual_mlp, linear (the recipe's spec).
const SPEC: &str = r#"{"layers":[{"type":"linear","in":8,"out":32},{"type":"gelu"},{"type":"residual_mlp","dim":32,"hidden":64},{"type":"linear","in":32,"out":1}]}"#;

fn options(devices: i32) -> ModelOptions {
    let mut options = ModelOptions::new().unwrap();
    options
        .set_seed(7)
        .unwrap()
        .set_devices(DeviceKind::Cpu, devices)
        .unwrap();
    options
}

// --- Stage plan ------------------------------------------------------------------------------

#[test]
fn stage_plan_equals_the_explicit_plan_of_the_options() {
    for plan in [vec![1, 3], vec![2, 1, 1], vec![4]] {
        let mut opts = options(2);
        opts.set_stage_plan(&plan).unwrap();
        let model = Model::new(SPEC, Some(&opts)).unwrap();
        assert_eq!(model.stage_plan().unwrap(), plan);
        assert_eq!(model.num_stages().unwrap(), plan.len() as i32);
    }
}

#[test]
fn stage_plan_set_at_runtime_reads_back_and_bad_plans_change_nothing() {
    let mut model = Model::new(SPEC, Some(&options(2))).unwrap();
    model.set_stage_plan(&[1, 3]).unwrap();
    assert_eq!(model.stage_plan().unwrap(), vec![1, 3]);
    let e = model.set_stage_plan(&[1, 1]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("covers"), "{}", e.message());
    let e = model.set_stage_plan(&[0, 4]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert_eq!(model.stage_plan().unwrap(), vec![1, 3]);
    model.set_stage_plan(&[]).unwrap(); // the planner again: every layer once
    assert_eq!(model.stage_plan().unwrap().iter().sum::<i32>(), 4);
}

#[test]
fn plan_stages_plans_without_changing_the_model_and_names_a_layer_over_the_limit() {
    let mut opts = options(2);
    opts.set_stage_plan(&[4]).unwrap();
    let model = Model::new(SPEC, Some(&opts)).unwrap();
    assert_eq!(model.plan_stages(0, 4).unwrap(), vec![1, 1, 1, 1]);
    assert_eq!(model.plan_stages(0, 9).unwrap(), vec![1, 1, 1, 1]); // one layer a stage at most
    let two = model.plan_stages(0, 2).unwrap();
    assert!(two.len() >= 2 && two.iter().sum::<i32>() == 4, "{:?}", two);
    // one byte a stage: the first layer with weights (layer 0) is over it
    let e = model.plan_stages(1, 0).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument);
    assert!(e.message().contains("layer 0 alone"), "{}", e.message());
    assert_eq!(
        model.plan_stages(-1, 0).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(
        model.plan_stages(0, -1).unwrap_err().status(),
        Status::InvalidArgument
    );
    assert_eq!(model.stage_plan().unwrap(), vec![4]); // the model's own plan is left alone
}

#[test]
fn planner_stage_plan_covers_every_layer_once() {
    for devices in [1, 2, 3] {
        let model = Model::new(SPEC, Some(&options(devices))).unwrap();
        let plan = model.stage_plan().unwrap();
        assert_eq!(plan.len() as i32, model.num_stages().unwrap());
        assert!(plan.iter().all(|&n| n > 0), "{:?}", plan);
        assert_eq!(plan.iter().sum::<i32>(), 4, "{:?}", plan);
        assert_eq!(model.num_layers().unwrap(), 4);
    }
}

// --- Resolved run configuration ----------------------------------------------------------------

#[test]
fn run_config_getters_report_unset_fields_and_what_was_set() {
    let mut config = RunConfig::new().unwrap();
    assert_eq!(config.num_microbatch().unwrap(), None);
    assert_eq!(config.recompute_grain().unwrap(), RecomputeGrain::Default);
    assert_eq!(config.output_device().unwrap(), None);
    assert_eq!(config.merge_output().unwrap(), None);
    config
        .set_num_microbatch(6)
        .unwrap()
        .set_recompute_grain(RecomputeGrain::Layer)
        .unwrap()
        .set_output_device(None)
        .unwrap()
        .set_merge_output(Some(false))
        .unwrap();
    assert_eq!(config.num_microbatch().unwrap(), Some(6));
    assert_eq!(config.recompute_grain().unwrap(), RecomputeGrain::Layer);
    assert_eq!(config.output_device().unwrap(), Some(Device::CPU));
    assert_eq!(config.merge_output().unwrap(), Some(false));
    config
        .set_num_microbatch(0)
        .unwrap()
        .set_merge_output(None)
        .unwrap();
    assert_eq!(config.num_microbatch().unwrap(), None);
    assert_eq!(config.merge_output().unwrap(), None);
}

#[test]
fn resolved_defaults_are_the_headers_num_microbatch_is_devices_plus_one() {
    for devices in [1, 2, 3] {
        let model = Model::new(SPEC, Some(&options(devices))).unwrap();
        assert_eq!(model.num_devices().unwrap(), devices);
        let resolved = model.resolve_run_config(None).unwrap();
        assert_eq!(resolved.num_microbatch().unwrap(), Some(devices + 1));
        assert_eq!(resolved.recompute_grain().unwrap(), RecomputeGrain::Stage);
        assert_eq!(resolved.output_device().unwrap(), Some(Device::CPU));
        assert_eq!(resolved.merge_output().unwrap(), Some(true));
    }
}

#[test]
fn resolved_values_are_the_calls_over_the_models() {
    let mut model_level = RunConfig::new().unwrap();
    model_level.set_num_microbatch(4).unwrap();
    let mut opts = options(2);
    opts.set_run_config(Some(&model_level)).unwrap();
    let model = Model::new(SPEC, Some(&opts)).unwrap();

    // The model's value where the call sets nothing.
    let resolved = model.resolve_run_config(None).unwrap();
    assert_eq!(resolved.num_microbatch().unwrap(), Some(4));

    // The call's value where it sets one; the model's and the defaults elsewhere.
    let mut call = RunConfig::new().unwrap();
    call.set_num_microbatch(5)
        .unwrap()
        .set_recompute_grain(RecomputeGrain::Layer)
        .unwrap();
    let resolved = model.resolve_run_config(Some(&call)).unwrap();
    assert_eq!(resolved.num_microbatch().unwrap(), Some(5));
    assert_eq!(resolved.recompute_grain().unwrap(), RecomputeGrain::Layer);
    assert_eq!(resolved.merge_output().unwrap(), Some(true));

    let mut only_merge = RunConfig::new().unwrap();
    only_merge.set_merge_output(Some(false)).unwrap();
    let resolved = model.resolve_run_config(Some(&only_merge)).unwrap();
    assert_eq!(resolved.num_microbatch().unwrap(), Some(4));
    assert_eq!(resolved.merge_output().unwrap(), Some(false));
    // The resolved configuration is the caller's to keep; the call's is unchanged.
    assert_eq!(only_merge.num_microbatch().unwrap(), None);
}

// --- Hugging Face names --------------------------------------------------------------------------

const QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 40,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "tie_word_embeddings": false, "dtype": "float32"}"#;

const LLAMA_TIED: &str = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 40,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": true,
    "torch_dtype": "float32"}"#;

/// `Qwen3ForCausalLM(config).named_parameters()` of transformers for QWEN3, written out.
const QWEN3_HF_NAMES: [&str; 25] = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.self_attn.q_norm.weight",
    "model.layers.0.self_attn.k_norm.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.1.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.self_attn.q_norm.weight",
    "model.layers.1.self_attn.k_norm.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.layers.1.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
];

/// The same for LLAMA_TIED: no q/k norms, and no lm_head.weight (tied to the embedding).
const LLAMA_TIED_HF_NAMES: [&str; 11] = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
];

/// The header's rule from our name to the Hugging Face one: "0.weight" is the embedding,
/// "<i>.<name>" of decoder layer i is "model.layers.<i - 1>.<name>", then the final norm and
/// the LM head.
fn hf_name_by_the_headers_rule(ours: &str, num_decoder_layers: usize) -> String {
    let (layer, local) = ours.split_once('.').unwrap();
    let layer: usize = layer.parse().unwrap();
    match layer {
        0 => format!("model.embed_tokens.{}", local),
        l if l <= num_decoder_layers => format!("model.layers.{}.{}", l - 1, local),
        l if l == num_decoder_layers + 1 => format!("model.norm.{}", local),
        _ => format!("lm_head.{}", local),
    }
}

fn hf_names(config: &str, expected: &[&str], num_decoder_layers: usize) {
    let model = Model::from_hf_config(config, Some(&options(2))).unwrap();
    let names: Vec<String> = (0..model.param_count().unwrap())
        .map(|i| model.param_hf_name(i).unwrap())
        .collect();
    assert_eq!(names, expected);
    for (i, name) in names.iter().enumerate() {
        let ours = model.param_name(i).unwrap();
        assert_eq!(
            *name,
            hf_name_by_the_headers_rule(&ours, num_decoder_layers),
            "parameter {} ({})",
            i,
            ours
        );
    }
}

#[test]
fn hf_names_of_a_tiny_qwen3_are_the_transformers_names() {
    hf_names(QWEN3, &QWEN3_HF_NAMES, 2);
}

#[test]
fn hf_names_of_a_tied_llama_are_the_transformers_names() {
    hf_names(LLAMA_TIED, &LLAMA_TIED_HF_NAMES, 1);
}

#[test]
fn hf_names_are_refused_for_a_spec_model_and_out_of_range() {
    let model = Model::new(SPEC, Some(&options(1))).unwrap();
    let e = model.param_hf_name(0).unwrap_err();
    assert_eq!(e.status(), Status::State, "{}", e);
    let hf = Model::from_hf_config(QWEN3, Some(&options(1))).unwrap();
    let e = hf.param_hf_name(QWEN3_HF_NAMES.len()).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{}", e);
}

// --- Microbatch split ----------------------------------------------------------------------------

fn rows(t: &Tensor) -> Vec<f32> {
    t.as_slice::<f32>().unwrap().to_vec()
}

#[test]
fn split_along_rows_has_tensor_split_sizes() {
    // 5 rows of 2 into 2 microbatches: torch.tensor_split gives 3 rows, then 2.
    let data: Vec<f32> = (0..10).map(|v| v as f32).collect();
    let x = Tensor::new(&data, &[5, 2]).unwrap();
    let pieces = split_microbatches(&x, Split::Dim(0), 2).unwrap();
    assert_eq!(pieces.len(), 2);
    assert_eq!(pieces[0].shape(), &[3, 2]);
    assert_eq!(rows(&pieces[0]), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(pieces[1].shape(), &[2, 2]);
    assert_eq!(rows(&pieces[1]), vec![6.0, 7.0, 8.0, 9.0]);
}

#[test]
fn split_along_an_inner_dimension_copies_the_strided_pieces() {
    // [[0, 1, 2], [3, 4, 5]] by columns into 2: columns {0, 1} and {2}.
    let data: Vec<f32> = (0..6).map(|v| v as f32).collect();
    let x = Tensor::new(&data, &[2, 3]).unwrap();
    let pieces = split_microbatches(&x, Split::Dim(1), 2).unwrap();
    assert_eq!(pieces[0].shape(), &[2, 2]);
    assert_eq!(rows(&pieces[0]), vec![0.0, 1.0, 3.0, 4.0]);
    assert_eq!(pieces[1].shape(), &[2, 1]);
    assert_eq!(rows(&pieces[1]), vec![2.0, 5.0]);
}

#[test]
fn replicate_and_0d_give_every_microbatch_the_whole_tensor() {
    let x = Tensor::new(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let pieces = split_microbatches(&x, Split::Replicate, 3).unwrap();
    assert_eq!(pieces.len(), 3);
    assert!(pieces.iter().all(|p| *p == x));
    let s = Tensor::scalar(2.5f32);
    let pieces = split_microbatches(&s, Split::Dim(0), 2).unwrap();
    assert!(pieces.iter().all(|p| *p == s));
}

#[test]
fn split_errors_are_the_engines() {
    let x = Tensor::new(&[0i64; 6], &[3, 2]).unwrap();
    // Fewer rows than microbatches, a dimension the tensor lacks, no microbatch.
    for (split, n) in [(Split::Dim(0), 4), (Split::Dim(2), 2), (Split::Dim(0), 0)] {
        let e = split_microbatches(&x, split, n).unwrap_err();
        assert_eq!(
            e.status(),
            Status::InvalidArgument,
            "{:?} {}: {}",
            split,
            n,
            e
        );
        assert!(!e.message().is_empty());
    }
}
