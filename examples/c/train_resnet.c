/*
 * train_resnet.c - a small residual network trained as a classifier.
 *
 * Four pre-norm residual MLP blocks between an input projection and a layer-normed classifier
 * head learn to sort synthetic 16-dimensional points into 4 classes. It shows, beyond
 * train_mlp.c: the cross-entropy loss with int64 labels, a per-call run configuration (layer-wise
 * recompute), changing the learning rate between asynchronous steps, reading parameter names and
 * shapes, and the devices chosen automatically (every visible GPU, else 2 CPU worker devices).
 *
 * Prints one line per step, "step N loss X", then the training accuracy; saves the weights,
 * reloads them into a fresh model and checks that it computes the same logits.
 *
 * Usage: train_resnet [--steps N] [--save PATH]
 */
#define _POSIX_C_SOURCE 200809L

#include "example_util.h"

#include <math.h>

enum { ROWS = 128, FEATURES = 16, CLASSES = 4, MICROBATCHES = 4 };

static const char *const SPEC =
    "{\"layers\":["
    "{\"type\":\"linear\",\"in\":16,\"out\":64},"
    "{\"type\":\"residual_mlp\",\"dim\":64,\"hidden\":128},"
    "{\"type\":\"residual_mlp\",\"dim\":64,\"hidden\":128,\"activation\":\"silu\"},"
    "{\"type\":\"residual_mlp\",\"dim\":64,\"hidden\":128,\"norm\":\"rms_norm\"},"
    "{\"type\":\"residual_mlp\",\"dim\":64,\"hidden\":128},"
    "{\"type\":\"layer_norm\",\"dim\":64},"
    "{\"type\":\"linear\",\"in\":64,\"out\":4}]}";

/* Points in [-1, 1)^16 from a 64-bit LCG; the class is decided by two simple features:
 * the sign of x0 + x1 and the sign of x2 * x3 - x4. */
static void make_data(float x[ROWS][FEATURES], int64_t labels[ROWS]) {
    uint64_t state = 2024;
    for (int i = 0; i < ROWS; ++i) {
        for (int j = 0; j < FEATURES; ++j) {
            state = state * 6364136223846793005ULL + 1442695040888963407ULL;
            x[i][j] = (float)(state >> 40) / 8388608.0f - 1.0f;
        }
        int a = x[i][0] + x[i][1] > 0.0f;
        int b = x[i][2] * x[i][3] - x[i][4] > 0.0f;
        labels[i] = 2 * a + b;
    }
}

static rp_model *create_model(uint64_t seed) {
    /* RP_DEVICE_AUTO with 0 devices means every visible GPU (or a single CPU worker device);
     * without a GPU we ask for 2 CPU worker devices so the pipeline really has two stages in
     * flight. */
    int32_t gpus = 0;
    CHECK(rp_cuda_device_count(&gpus));
    rp_model_options *options = NULL;
    rp_model *model = NULL;
    CHECK(rp_model_options_create(&options));
    CHECK(rp_model_options_set_seed(options, seed));
    CHECK(rp_model_options_set_devices(options, RP_DEVICE_AUTO, gpus > 0 ? 0 : 2));
    CHECK(rp_model_options_set_name(options, "train_resnet"));
    CHECK(rp_model_create(&model, SPEC, options));
    rp_model_options_destroy(options);
    return model;
}

static float *logits_of(rp_model *model, const example_tensor *input, const rp_run_config *config,
                        size_t *count) {
    const DLManagedTensor *inputs[1] = {&input->managed};
    rp_tensor_list *outputs = NULL;
    CHECK(rp_forward(&outputs, model, inputs, 1, config));
    float *values = example_output_copy(outputs, 0, count);
    rp_tensor_list_destroy(outputs);
    if (values == NULL || *count != (size_t)ROWS * CLASSES) {
        fprintf(stderr, "error: expected %d logits\n", ROWS * CLASSES);
        exit(EXIT_FAILURE);
    }
    return values;
}

int main(int argc, char **argv) {
    int steps = 40;
    const char *save_path = NULL;
    for (int a = 1; a < argc; ++a) {
        if (strcmp(argv[a], "--steps") == 0 && a + 1 < argc) {
            steps = atoi(argv[++a]);
        } else if (strcmp(argv[a], "--save") == 0 && a + 1 < argc) {
            save_path = argv[++a];
        } else {
            fprintf(stderr, "usage: %s [--steps N] [--save PATH]\n", argv[0]);
            return EXIT_FAILURE;
        }
    }
    if (steps < 2) {
        fprintf(stderr, "--steps must be at least 2\n");
        return EXIT_FAILURE;
    }

    static float x[ROWS][FEATURES];
    static int64_t labels_data[ROWS];
    make_data(x, labels_data);
    example_tensor input, labels;
    example_tensor_f32(&input, &x[0][0], 2, (const int64_t[]){ROWS, FEATURES});
    example_tensor_i64(&labels, labels_data, 1, (const int64_t[]){ROWS});
    const DLManagedTensor *inputs[1] = {&input.managed};

    rp_model *model = create_model(1);

    /* Parameters are named "<layer>.<name>", e.g. "1.fc1.weight". */
    size_t n_params = 0, n_values = 0;
    CHECK(rp_param_count(&n_params, model));
    for (size_t p = 0; p < n_params; ++p) {
        int64_t shape[8];
        int32_t ndim = 0;
        CHECK(rp_param_shape(shape, &ndim, 8, model, p));
        size_t size = 1;
        for (int32_t d = 0; d < ndim && d < 8; ++d)
            size *= (size_t)shape[d];
        n_values += size;
    }
    const char *first_name = NULL;
    CHECK(rp_param_name(&first_name, model, 0));
    int32_t layers = 0, stages = 0, devices = 0;
    CHECK(rp_model_num_layers(&layers, model));
    CHECK(rp_model_num_stages(&stages, model));
    CHECK(rp_model_num_devices(&devices, model));
    printf("model: %d layers, %zu parameter tensors (%s, ...), %zu values; %d stages on %d "
           "device(s)\n",
           (int)layers, n_params, first_name, n_values, (int)stages, (int)devices);

    /* Per-call configuration: 4 microbatches, recompute one layer at a time in backward (lower
     * peak memory than recomputing whole stages; same numbers). */
    rp_run_config *config = NULL;
    CHECK(rp_run_config_create(&config));
    CHECK(rp_run_config_set_num_microbatch(config, MICROBATCHES));
    CHECK(rp_run_config_set_recompute_grain(config, RP_GRAIN_LAYER));

    rp_loss *loss = NULL;
    CHECK(rp_loss_create(&loss, RP_LOSS_CROSS_ENTROPY));
    CHECK(rp_loss_set_scale(loss, 1.0 / MICROBATCHES)); /* batch mean */
    rp_optimizer *adamw = NULL;
    CHECK(rp_optimizer_create(&adamw, RP_OPTIMIZER_ADAMW));
    CHECK(rp_optimizer_set_weight_decay(adamw, 0.01));

    const double peak_lr = 1e-3;
    double first_loss = 0.0, last_loss = 0.0;
    for (int step = 0; step < steps; ++step) {
        /* Cosine decay from peak_lr to peak_lr / 10; the settings are copied at each rp_step. */
        double progress = (double)step / (double)(steps - 1);
        double lr = peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + cos(3.14159265358979323846 * progress)));
        CHECK(rp_optimizer_set_learning_rate(adamw, lr));

        double value = 0.0;
        CHECK(rp_forward_backward(&value, NULL, model, inputs, 1, &labels.managed, loss, config));
        CHECK(rp_step(model, adamw, 1)); /* asynchronous */
        printf("step %d loss %.6f\n", step, value);
        fflush(stdout);
        if (step == 0)
            first_loss = value;
        last_loss = value;
    }
    CHECK(rp_synchronize(model));

    size_t n_logits = 0;
    float *logits = logits_of(model, &input, config, &n_logits);
    int correct = 0;
    for (int i = 0; i < ROWS; ++i) {
        int best = 0;
        for (int c = 1; c < CLASSES; ++c)
            if (logits[i * CLASSES + c] > logits[i * CLASSES + best])
                best = c;
        correct += best == labels_data[i];
    }
    printf("train accuracy %.4f (%d/%d)\n", (double)correct / ROWS, correct, ROWS);

    int status = EXIT_SUCCESS;
    if (!(last_loss < 0.5 * first_loss)) {
        fprintf(stderr, "error: the loss did not fall enough (%g -> %g)\n", first_loss, last_loss);
        status = EXIT_FAILURE;
    }

    /* Save the trained weights and load them into a model initialised differently. */
    char temp_dir[4096], path[4200];
    if (example_output_path(path, sizeof(path), temp_dir, sizeof(temp_dir), save_path,
                            "train_resnet.safetensors") != 0)
        return EXIT_FAILURE;
    CHECK(rp_model_save(model, path));
    rp_model *reloaded = create_model(99);
    CHECK(rp_model_load(reloaded, path));
    size_t n_reloaded = 0;
    float *reloaded_logits = logits_of(reloaded, &input, config, &n_reloaded);
    double worst = 0.0;
    for (size_t i = 0; i < n_logits; ++i) {
        double d = fabs((double)logits[i] - (double)reloaded_logits[i]);
        if (!(d <= worst))
            worst = d;
    }
    printf("reload max |logit difference| %.3g\n", worst);
    if (!(worst <= 1e-5)) {
        fprintf(stderr, "error: the reloaded model computes different logits\n");
        status = EXIT_FAILURE;
    }

    free(logits);
    free(reloaded_logits);
    rp_model_destroy(reloaded);
    rp_model_destroy(model);
    rp_run_config_destroy(config);
    rp_optimizer_destroy(adamw);
    rp_loss_destroy(loss);
    if (save_path == NULL) {
        remove(path);
        rmdir(temp_dir);
    }
    return status;
}
