/*
 * finetune_util.h - the fine-tuning loop shared by finetune_qwen3.c and finetune_llama.c.
 *
 * A causal LM is built from a Hugging Face config.json text (random weights, seeded), trained for
 * a few asynchronous AdamW steps on a synthetic task (continue arithmetic progressions modulo the
 * vocabulary, padded batch, prompt tokens without a target), saved as a Hugging Face directory,
 * loaded back with rp_model_create_from_hf and checked to compute the same logits. The saved
 * directory loads in transformers (AutoModelForCausalLM.from_pretrained).
 *
 * Not part of the RoundPipe API: copy what you need into your own program.
 */
#ifndef ROUNDPIPE_FINETUNE_UTIL_H
#define ROUNDPIPE_FINETUNE_UTIL_H

#include "example_util.h"

#include <math.h>

enum { FT_BATCH = 8, FT_SEQ = 32, FT_PROMPT = 4, FT_STEPS = 12, FT_MICROBATCHES = 4 };

/* The batch: token ids, attention mask (1: real token, 0: padding), labels (-100: no target). */
typedef struct ft_batch {
    int64_t ids[FT_BATCH][FT_SEQ];
    int64_t mask[FT_BATCH][FT_SEQ];
    int64_t labels[FT_BATCH][FT_SEQ];
} ft_batch;

/* Row i counts from start_i in steps of step_i modulo the vocabulary; rows have different
 * lengths (right padding). The first FT_PROMPT tokens are the prompt: no loss on them, as in
 * supervised fine-tuning. */
static inline void ft_make_batch(ft_batch *b, int64_t vocab) {
    uint64_t state = 7;
    for (int i = 0; i < FT_BATCH; ++i) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        int64_t start = (int64_t)((state >> 33) % (uint64_t)vocab);
        int64_t step = 1 + i % 5;
        int length = FT_SEQ - 3 * (i % 4);
        for (int t = 0; t < FT_SEQ; ++t) {
            int real = t < length;
            b->ids[i][t] = real ? (start + step * t) % vocab : 0;
            b->mask[i][t] = real;
            b->labels[i][t] = real && t >= FT_PROMPT ? b->ids[i][t] : -100;
        }
    }
}

static inline rp_model *ft_create(const char *config_json, const char *dir, int32_t device_kind,
                                  int32_t num_devices) {
    rp_model_options *options = NULL;
    rp_run_config *config = NULL;
    rp_model *model = NULL;
    CHECK(rp_model_options_create(&options));
    CHECK(rp_model_options_set_seed(options, 1));
    CHECK(rp_model_options_set_devices(options, device_kind, num_devices));
    CHECK(rp_run_config_create(&config));
    CHECK(rp_run_config_set_num_microbatch(config, FT_MICROBATCHES));
    CHECK(rp_model_options_set_run_config(options, config));
    rp_run_config_destroy(config);
    if (config_json != NULL)
        CHECK(rp_model_create_from_hf_config(&model, config_json, options));
    else
        CHECK(rp_model_create_from_hf(&model, dir, options));
    rp_model_options_destroy(options);
    return model;
}

static inline float *ft_logits(rp_model *model, const DLManagedTensor *const *inputs,
                               size_t *count) {
    rp_tensor_list *outputs = NULL;
    CHECK(rp_forward(&outputs, model, inputs, 2, NULL));
    float *values = example_output_copy(outputs, 0, count);
    rp_tensor_list_destroy(outputs);
    if (values == NULL)
        exit(EXIT_FAILURE);
    return values;
}

/* Parses [--device cpu|auto] [--save DIR], trains, saves, reloads. Returns the exit status. */
static inline int ft_main(int argc, char **argv, const char *family, const char *config_json,
                          int64_t vocab) {
    int32_t device_kind = RP_DEVICE_CPU, num_devices = 2;
    const char *save_dir = NULL;
    for (int a = 1; a < argc; ++a) {
        if (strcmp(argv[a], "--device") == 0 && a + 1 < argc) {
            const char *kind = argv[++a];
            int32_t gpus = 0;
            CHECK(rp_cuda_device_count(&gpus));
            if (strcmp(kind, "cpu") == 0) {
                device_kind = RP_DEVICE_CPU;
                num_devices = 2;
            } else if (strcmp(kind, "auto") == 0) {
                device_kind = RP_DEVICE_AUTO;
                num_devices = gpus > 0 ? 0 : 2;
            } else {
                fprintf(stderr, "unknown device kind '%s' (expected cpu or auto)\n", kind);
                return EXIT_FAILURE;
            }
        } else if (strcmp(argv[a], "--save") == 0 && a + 1 < argc) {
            save_dir = argv[++a];
        } else {
            fprintf(stderr, "usage: %s [--device cpu|auto] [--save DIR]\n", argv[0]);
            return EXIT_FAILURE;
        }
    }

    /* Saving and loading the Hugging Face directory show their progress on one line. */
    CHECK(rp_set_progress_callback(example_show_progress, NULL));
    static ft_batch batch;
    ft_make_batch(&batch, vocab);
    const int64_t shape[2] = {FT_BATCH, FT_SEQ};
    example_tensor ids, mask, labels;
    example_tensor_i64(&ids, &batch.ids[0][0], 2, shape);
    example_tensor_i64(&mask, &batch.mask[0][0], 2, shape);
    example_tensor_i64(&labels, &batch.labels[0][0], 2, shape);
    /* Input 0: token ids; input 1: the attention mask, split into microbatches alongside. */
    const DLManagedTensor *inputs[2] = {&ids.managed, &mask.managed};

    rp_model *model = ft_create(config_json, NULL, device_kind, num_devices);
    int32_t stages = 0, devices = 0;
    CHECK(rp_model_num_stages(&stages, model));
    CHECK(rp_model_num_devices(&devices, model));
    fprintf(stderr, "%s: %d stage(s) on %d device(s)\n", family, (int)stages, (int)devices);

    /* Causal-LM loss fused into the LM head, in vocabulary chunks; the value is the mean over
     * every target token of the batch, whatever the number of microbatches. */
    rp_loss *loss = NULL;
    CHECK(rp_loss_create(&loss, RP_LOSS_CAUSAL_LM));
    rp_optimizer *adamw = NULL;
    CHECK(rp_optimizer_create(&adamw, RP_OPTIMIZER_ADAMW));
    CHECK(rp_optimizer_set_learning_rate(adamw, 3e-3));
    CHECK(rp_optimizer_set_weight_decay(adamw, 0.0));

    double first = 0.0, last = 0.0;
    for (int step = 0; step < FT_STEPS; ++step) {
        double value = 0.0;
        CHECK(rp_forward_backward(&value, NULL, model, inputs, 2, &labels.managed, loss, NULL));
        CHECK(rp_step(model, adamw, 1));
        printf("step %d loss %.6f\n", step, value);
        fflush(stdout);
        if (step == 0)
            first = value;
        last = value;
    }
    CHECK(rp_synchronize(model));
    int status = EXIT_SUCCESS;
    if (!(last < first)) {
        fprintf(stderr, "error: the loss did not fall (%g -> %g)\n", first, last);
        status = EXIT_FAILURE;
    }

    /* Save as a Hugging Face directory and load it back. */
    char temp_dir[4096], dir[4200];
    if (example_output_path(dir, sizeof(dir), temp_dir, sizeof(temp_dir), save_dir, family) != 0)
        return EXIT_FAILURE;
    CHECK(rp_model_save_hf(model, dir));
    rp_model *reloaded = ft_create(NULL, dir, device_kind, num_devices);
    size_t n_a = 0, n_b = 0;
    float *a = ft_logits(model, inputs, &n_a);
    float *b = ft_logits(reloaded, inputs, &n_b);
    double worst = n_a == n_b ? 0.0 : INFINITY;
    for (size_t i = 0; i < n_a && n_a == n_b; ++i) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= worst))
            worst = d;
    }
    fprintf(stderr, "saved %s; max |logit difference| after reloading %.3g\n", dir, worst);
    if (!(worst <= 1e-5)) {
        fprintf(stderr, "error: the reloaded model computes different logits\n");
        status = EXIT_FAILURE;
    }
    free(a);
    free(b);
    rp_model_destroy(reloaded);
    rp_model_destroy(model);
    rp_optimizer_destroy(adamw);
    rp_loss_destroy(loss);

    if (save_dir == NULL) {
        /* The directory holds config.json and model.safetensors. */
        const char *files[2] = {"config.json", "model.safetensors"};
        char path[4400];
        for (int i = 0; i < 2; ++i) {
            snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
            remove(path);
        }
        rmdir(dir);
        rmdir(temp_dir);
    }
    return status;
}

#endif /* ROUNDPIPE_FINETUNE_UTIL_H */
