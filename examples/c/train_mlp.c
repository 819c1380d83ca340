/*
 * train_mlp.c - the shared training recipe (examples/RECIPE.md) in C.
 *
 * Builds a small MLP from a JSON spec, trains it for 20 asynchronous AdamW steps on a fixed
 * synthetic batch, prints one line per step, then saves the weights to a safetensors file,
 * loads them into a freshly created model and checks that both models compute the same outputs.
 *
 * Standard output carries only the lines the recipe prescribes (so every language's example can
 * be compared line by line); everything else goes to standard error.
 *
 * Usage: train_mlp [--device cpu|auto] [--save PATH]
 *   --device cpu   2 CPU worker devices, as the recipe says (default)
 *   --device auto  every visible GPU, else 2 CPU worker devices (losses then match the recipe's
 *                  to about 1e-6 rather than exactly)
 *   --save PATH    keep the weights at PATH (default: a temporary folder, removed at the end)
 */
#define _POSIX_C_SOURCE 200809L

#include "example_util.h"

#include <math.h>

enum { ROWS = 24, COLS = 8, STEPS = 20, MICROBATCHES = 3 };

static const char *const SPEC = "{\"layers\":["
                                "{\"type\":\"linear\",\"in\":8,\"out\":32},"
                                "{\"type\":\"gelu\"},"
                                "{\"type\":\"residual_mlp\",\"dim\":32,\"hidden\":64},"
                                "{\"type\":\"linear\",\"in\":32,\"out\":1}]}";

/* The recipe's data: a 64-bit LCG (Knuth's MMIX constants) gives exact fp32 inputs in [-1, 1);
 * the label of a row is the sum of the sines of its inputs, in double, rounded once to fp32. */
static void make_data(float x[ROWS][COLS], float y[ROWS][1]) {
    uint64_t state = 42;
    for (int i = 0; i < ROWS; ++i) {
        double sum = 0.0;
        for (int j = 0; j < COLS; ++j) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            x[i][j] = (float)(state >> 40) / 8388608.0f - 1.0f;
            sum += sin((double)x[i][j]);
        }
        y[i][0] = (float)sum;
    }
}

/* A model with the recipe's options: seed, devices and 3 microbatches per call. */
static rp_model *create_model(uint64_t seed, int32_t device_kind, int32_t num_devices) {
    rp_model_options *options = NULL;
    rp_run_config *config = NULL;
    rp_model *model = NULL;
    CHECK(rp_model_options_create(&options));
    CHECK(rp_model_options_set_seed(options, seed));
    CHECK(rp_model_options_set_devices(options, device_kind, num_devices));
    CHECK(rp_run_config_create(&config));
    CHECK(rp_run_config_set_num_microbatch(config, MICROBATCHES));
    CHECK(rp_model_options_set_run_config(options, config)); /* the options keep a copy */
    rp_run_config_destroy(config);
    CHECK(rp_model_create(&model, SPEC, options));
    rp_model_options_destroy(options);
    return model;
}

/* Inference on `input`; returns the outputs as a malloc'd fp32 array of *count values. */
static float *predict(rp_model *model, const example_tensor *input, size_t *count) {
    const DLManagedTensor *inputs[1] = {&input->managed};
    rp_tensor_list *outputs = NULL;
    CHECK(rp_forward(&outputs, model, inputs, 1, NULL));
    float *values = example_output_copy(outputs, 0, count);
    rp_tensor_list_destroy(outputs);
    if (values == NULL)
        exit(EXIT_FAILURE);
    return values;
}

static double max_abs_diff(const float *a, const float *b, size_t n) {
    double worst = 0.0;
    for (size_t i = 0; i < n; ++i) {
        double d = fabs((double)a[i] - (double)b[i]);
        if (!(d <= worst)) /* also catches NaN */
            worst = d;
    }
    return worst;
}

int main(int argc, char **argv) {
    int32_t device_kind = RP_DEVICE_CPU, num_devices = 2;
    const char *save_path = NULL;
    for (int a = 1; a < argc; ++a) {
        if (strcmp(argv[a], "--device") == 0 && a + 1 < argc) {
            const char *kind = argv[++a];
            if (strcmp(kind, "cpu") == 0) {
                device_kind = RP_DEVICE_CPU;
                num_devices = 2;
            } else if (strcmp(kind, "auto") == 0) {
                /* RP_DEVICE_AUTO with 0 devices means every visible GPU; without a GPU, ask for
                 * 2 CPU worker devices instead of the single one 0 would give. */
                int32_t gpus = 0;
                CHECK(rp_cuda_device_count(&gpus));
                device_kind = RP_DEVICE_AUTO;
                num_devices = gpus > 0 ? 0 : 2;
            } else {
                fprintf(stderr, "unknown device kind '%s' (expected cpu or auto)\n", kind);
                return EXIT_FAILURE;
            }
        } else if (strcmp(argv[a], "--save") == 0 && a + 1 < argc) {
            save_path = argv[++a];
        } else {
            fprintf(stderr, "usage: %s [--device cpu|auto] [--save PATH]\n", argv[0]);
            return EXIT_FAILURE;
        }
    }

    static float x[ROWS][COLS], y[ROWS][1];
    make_data(x, y);
    printf("data %.17g %.17g %.17g\n", (double)x[0][0], (double)x[0][1], (double)y[0][0]);

    /* Inputs and labels are borrowed DLPack views of the arrays above: no copy on our side. */
    example_tensor input, labels;
    example_tensor_f32(&input, &x[0][0], 2, (const int64_t[]){ROWS, COLS});
    example_tensor_f32(&labels, &y[0][0], 2, (const int64_t[]){ROWS, 1});
    const DLManagedTensor *inputs[1] = {&input.managed};

    rp_model *model = create_model(42, device_kind, num_devices);
    int32_t devices = 0, stages = 0;
    CHECK(rp_model_num_devices(&devices, model));
    CHECK(rp_model_num_stages(&stages, model));
    fprintf(stderr, "roundpipe %s: %d stage(s) on %d device(s)\n", rp_version(), (int)stages,
            (int)devices);

    /* Mean squared error per microbatch; scaling by 1/3 makes the summed loss the batch mean. */
    rp_loss *loss = NULL;
    CHECK(rp_loss_create(&loss, RP_LOSS_MSE));
    CHECK(rp_loss_set_scale(loss, 1.0 / MICROBATCHES));
    rp_optimizer *adamw = NULL;
    CHECK(rp_optimizer_create(&adamw, RP_OPTIMIZER_ADAMW));
    CHECK(rp_optimizer_set_learning_rate(adamw, 1e-2));

    double first_loss = 0.0, last_loss = 0.0;
    for (int step = 0; step < STEPS; ++step) {
        double value = 0.0;
        CHECK(rp_forward_backward(&value, NULL, model, inputs, 1, &labels.managed, loss, NULL));
        /* Asynchronous: the update runs on the optimizer thread while the next forward_backward
         * already computes, on weights one step old. */
        CHECK(rp_step(model, adamw, 1));
        printf("step %d loss %.17g\n", step, value);
        fflush(stdout);
        if (step == 0)
            first_loss = value;
        last_loss = value;
    }
    CHECK(rp_synchronize(model)); /* wait for the last step and publish its weights */

    int status = EXIT_SUCCESS;
    if (!(last_loss < first_loss)) {
        fprintf(stderr, "error: the loss did not fall (%g -> %g)\n", first_loss, last_loss);
        status = EXIT_FAILURE;
    }

    /* Save, then load into a model initialised from another seed, and compare the outputs. */
    char temp_dir[4096], path[4200];
    if (example_output_path(path, sizeof(path), temp_dir, sizeof(temp_dir), save_path,
                            "train_mlp.safetensors") != 0)
        return EXIT_FAILURE;
    CHECK(rp_model_save(model, path));

    rp_model *reloaded = create_model(7, device_kind, num_devices);
    size_t n_trained = 0, n_fresh = 0, n_reloaded = 0;
    float *trained = predict(model, &input, &n_trained);
    float *fresh = predict(reloaded, &input, &n_fresh);
    CHECK(rp_model_load(reloaded, path));
    float *restored = predict(reloaded, &input, &n_reloaded);

    if (n_trained != n_reloaded || n_trained != n_fresh) {
        fprintf(stderr, "error: output sizes differ (%zu, %zu, %zu)\n", n_trained, n_fresh,
                n_reloaded);
        status = EXIT_FAILURE;
    } else {
        double before = max_abs_diff(trained, fresh, n_trained);
        double after = max_abs_diff(trained, restored, n_trained);
        fprintf(stderr, "saved %s; max |output difference| before load %.3g, after load %.3g\n",
                path, before, after);
        /* Same fp32 weights, same engine, same split: the outputs should be identical; allow
         * a rounding-level difference in case a device's kernels are not bitwise reproducible. */
        if (!(after <= 1e-6)) {
            fprintf(stderr, "error: the reloaded model computes different outputs\n");
            status = EXIT_FAILURE;
        }
    }

    free(trained);
    free(fresh);
    free(restored);
    rp_model_destroy(reloaded);
    rp_model_destroy(model);
    rp_optimizer_destroy(adamw);
    rp_loss_destroy(loss);
    if (save_path == NULL) {
        remove(path);
        rmdir(temp_dir);
    }
    return status;
}
