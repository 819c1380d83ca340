/* A program of RoundPipe's users, built against an installed RoundPipe (tests/install): it
 * checks the versions the library reports, then trains a linear model on y = x . w + 1 with SGD
 * and requires the loss to fall to a hundredth. What it proves is that a program built with the
 * pkg-config line or with find_package(roundpipe) links and starts with no loader cache and no
 * LD_LIBRARY_PATH, and that the library it loads trains. */
#include <math.h>
#include <roundpipe.h>
#include <stdio.h>
#include <string.h>

#ifndef RP_EXPECTED_TORCH
#error "build with -DRP_EXPECTED_TORCH=\"<torch version>\""
#endif

#define CHECK(call)                                                                                \
    do {                                                                                           \
        rp_status s_ = (call);                                                                     \
        if (s_ != RP_OK) {                                                                         \
            fprintf(stderr, "%s: %s: %s\n", #call, rp_status_string(s_), rp_last_error_message()); \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

int main(void) {
    printf("roundpipe %s, ABI %d, built against torch %s\n", rp_version(), (int)rp_abi_version(),
           rp_torch_version());
    if (rp_abi_version() != RP_ABI_VERSION || strcmp(rp_torch_version(), RP_EXPECTED_TORCH) != 0) {
        fprintf(stderr, "expected ABI %d and torch %s\n", RP_ABI_VERSION, RP_EXPECTED_TORCH);
        return 1;
    }

    static float x[32][4], y[32][1];
    const float w[4] = {0.5f, -1.0f, 0.25f, 2.0f};
    uint32_t seed = 12345;
    for (int i = 0; i < 32; ++i) {
        y[i][0] = 1.0f;
        for (int j = 0; j < 4; ++j) {
            seed = seed * 1664525u + 1013904223u; /* uniform in [-1, 1) */
            x[i][j] = (float)(seed >> 8) / (float)(1u << 23) - 1.0f;
            y[i][0] += w[j] * x[i][j];
        }
    }
    int64_t x_shape[2] = {32, 4}, y_shape[2] = {32, 1};
    DLManagedTensor input = {.dl_tensor = {.data = x,
                                           .device = {kDLCPU, 0},
                                           .ndim = 2,
                                           .dtype = {kDLFloat, 32, 1},
                                           .shape = x_shape}};
    DLManagedTensor target = {.dl_tensor = {.data = y,
                                            .device = {kDLCPU, 0},
                                            .ndim = 2,
                                            .dtype = {kDLFloat, 32, 1},
                                            .shape = y_shape}};
    const DLManagedTensor *inputs[1] = {&input};

    /* Two microbatches whose mean squared errors, scaled by 1/2, add up to the batch mean. */
    rp_model_options *options;
    rp_run_config *config;
    rp_model *model;
    rp_loss *mse;
    rp_optimizer *sgd;
    CHECK(rp_model_options_create(&options));
    CHECK(rp_model_options_set_seed(options, 1));
    CHECK(rp_model_options_set_devices(options, RP_DEVICE_CPU, 1));
    CHECK(rp_run_config_create(&config));
    CHECK(rp_run_config_set_num_microbatch(config, 2));
    CHECK(rp_model_options_set_run_config(options, config));
    rp_run_config_destroy(config);
    CHECK(rp_model_create(&model, "{\"layers\": [{\"type\": \"linear\", \"in\": 4, \"out\": 1}]}",
                          options));
    rp_model_options_destroy(options);
    CHECK(rp_loss_create(&mse, RP_LOSS_MSE));
    CHECK(rp_loss_set_scale(mse, 0.5));
    CHECK(rp_optimizer_create(&sgd, RP_OPTIMIZER_SGD));
    CHECK(rp_optimizer_set_learning_rate(sgd, 0.2));

    double first = 0, loss = 0;
    for (int step = 0; step < 200; ++step) {
        CHECK(rp_forward_backward(&loss, NULL, model, inputs, 1, &target, mse, NULL));
        CHECK(rp_step(model, sgd, 0));
        if (step == 0)
            first = loss;
    }
    printf("loss %g -> %g\n", first, loss);
    rp_optimizer_destroy(sgd);
    rp_loss_destroy(mse);
    rp_model_destroy(model);
    if (!(isfinite(loss) && loss < first / 100)) {
        fprintf(stderr, "the loss did not fall to a hundredth\n");
        return 1;
    }
    return 0;
}
