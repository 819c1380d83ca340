/*
 * finetune_qwen3.c - fine-tune a tiny, randomly initialised Qwen3 (tied embeddings, per-head
 * q/k norms) for a few steps from C, save it as a Hugging Face directory and load it back.
 *
 * Usage: finetune_qwen3 [--device cpu|auto] [--save DIR]
 *   --device cpu   2 CPU worker devices (default)
 *   --device auto  every visible GPU, else 2 CPU worker devices
 *   --save DIR     keep the Hugging Face directory at DIR (default: a temporary folder)
 * A real checkpoint goes the same way: rp_model_create_from_hf(&model, "path/to/Qwen3-0.6B", opts).
 */
#define _POSIX_C_SOURCE 200809L

#include "finetune_util.h"

/* Qwen3-0.6B's shape, shrunk: tied embeddings, head_dim given explicitly, 4 query heads sharing
 * 2 key-value heads. */
static const char *const CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\","
    " \"vocab_size\": 128, \"hidden_size\": 64, \"intermediate_size\": 192,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"head_dim\": 16, \"hidden_act\": \"silu\", \"max_position_embeddings\": 4096,"
    " \"rms_norm_eps\": 1e-6, \"rope_parameters\": {\"rope_type\": \"default\","
    " \"rope_theta\": 1000000.0}, \"tie_word_embeddings\": true, \"use_sliding_window\": false,"
    " \"attention_bias\": false, \"initializer_range\": 0.02, \"dtype\": \"float32\"}";

int main(int argc, char **argv) { return ft_main(argc, argv, "qwen3", CONFIG, 128); }
