/*
 * transformer_reference.h - a plain libtorch Qwen3 / Llama causal LM for the transformer tests.
 *
 * It shares no code with src/: config.json is read here (nlohmann), the weights with the
 * reference's own safetensors reader (reference.h), and the model is written out op by op the
 * way the Hugging Face model classes define it: explicit softmax attention (no
 * scaled_dot_product_attention, no chunking), rotary angles in double precision, the whole batch
 * at once with full autograd, the loss as torch's cross entropy with ignore_index -100 averaged
 * over the batch's targets. Only the rules docs/semantics.md adds are followed as written there:
 * a query always attends to itself; padded keys (mask 0) are hidden.
 *
 * Every function that can fail returns 0 on success and -1 on failure (NULL for ref_lm_load);
 * ref_lm_last_error() then says why. Callable from C.
 */
#ifndef RP_TEST_TRANSFORMER_REFERENCE_H
#define RP_TEST_TRANSFORMER_REFERENCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ref_lm ref_lm;

/** Message of the last failure on this thread ("" when none). */
const char *ref_lm_last_error(void);

/** Load `dir`/config.json and `dir`/model.safetensors (one file). */
ref_lm *ref_lm_load(const char *dir);
void ref_lm_destroy(ref_lm *model);

int64_t ref_lm_vocab(const ref_lm *model);

/**
 * The whole batch at once. `ids`, and when not NULL `mask` (0: padding), `positions` and
 * `labels` (-100: no target), are row-major [batch, seq]. `out_logits` (may be NULL) receives
 * [batch, seq, vocab]. With labels, `out_loss` receives the mean cross entropy of logits[:, i]
 * against labels[:, i + 1] over every target of the batch, and the gradients of every weight
 * are computed (replacing those of an earlier call).
 */
int ref_lm_run(ref_lm *model, const int64_t *ids, const int64_t *mask, const int64_t *positions,
               const int64_t *labels, int64_t batch, int64_t seq, float *out_logits,
               double *out_loss);

/**
 * Add the LoRA adapters of a PEFT adapter directory (`dir`/adapter_config.json: r, lora_alpha,
 * target_modules; `dir`/adapter_model.safetensors: "base_model.model.<module>.lora_A.weight" and
 * ".lora_B.weight"): each adapted projection computes x W^T + b + (lora_alpha / r) (x A^T) B^T,
 * as PEFT's LoRA Linear does without dropout. The adapters are then the only tensors with
 * gradients, named without PEFT's prefix ("model.layers.0.self_attn.q_proj.lora_A.weight").
 */
int ref_lm_load_adapter(ref_lm *model, const char *dir);

/** One torch::optim::AdamW step (decoupled weight decay) of the adapters on the gradients of the
 * last run with labels; the optimizer state persists across calls. */
int ref_lm_step_adamw(ref_lm *model, double lr, double beta1, double beta2, double eps,
                      double weight_decay);

/** Number of elements of Hugging Face tensor `name` (-1 when the model has none). */
int64_t ref_lm_numel(const ref_lm *model, const char *name);
/** Weight / gradient (after a run with labels) of Hugging Face tensor `name`, as fp32. For a
 * tied model "lm_head.weight" is absent: "model.embed_tokens.weight" holds both uses. */
int ref_lm_weight(const ref_lm *model, const char *name, float *out, int64_t numel);
int ref_lm_grad(const ref_lm *model, const char *name, float *out, int64_t numel);

#ifdef __cplusplus
}
#endif

#endif /* RP_TEST_TRANSFORMER_REFERENCE_H */
