/*
 * finetune_llama.c - fine-tune a tiny, randomly initialised Llama (Llama 3.1 rope scaling,
 * untied LM head) for a few steps from C, save it as a Hugging Face directory and load it back.
 *
 * Usage: finetune_llama [--device cpu|auto] [--save DIR]
 *   --device cpu   2 CPU worker devices (default)
 *   --device auto  every visible GPU, else 2 CPU worker devices
 *   --save DIR     keep the Hugging Face directory at DIR (default: a temporary folder)
 * A real checkpoint goes the same way: rp_model_create_from_hf(&model, "path/to/Llama-3.2-1B",
 * opts).
 */
#define _POSIX_C_SOURCE 200809L

#include "finetune_util.h"

/* Llama 3.2's shape, shrunk: grouped-query attention and the llama3 rope scaling. */
static const char *const CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
    " \"vocab_size\": 128, \"hidden_size\": 64, \"intermediate_size\": 192,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
    " \"hidden_act\": \"silu\", \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-5,"
    " \"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 32.0,"
    " \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
    " \"original_max_position_embeddings\": 8192}, \"tie_word_embeddings\": false,"
    " \"initializer_range\": 0.02, \"dtype\": \"float32\"}";

int main(int argc, char **argv) { return ft_main(argc, argv, "llama", CONFIG, 128); }
