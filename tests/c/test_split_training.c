/*
 * test_split_training.c - upstream's non-fused training through the C API: rp_forward_train,
 * then rp_backward with the caller's gradients of the outputs. Two linear layers in two stages
 * on two CPU worker devices, weights set by hand; the expected gradients are worked out in C (in
 * double) from the chain rule: for h = W1 x + b1, y = W2 h + b2 and dL/dy = g per row,
 * dW2 = sum g h^T, db2 = sum g, dh = W2^T g, dW1 = sum dh x^T, db1 = sum dh. fp32 engine against
 * double reference: 1e-5 relative (a few fp32 roundings of 4-term sums).
 * rp_backward_input_grads adds dx = W1^T W2^T g per row, and two one-layer models chained
 * through it must give the two-layer model's gradients, and so must a plan whose backward
 * stages differ from the forward ones (rp_model_set_backward_stage_plan).
 */
#include "test_support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS = 6, IN = 3, HID = 2, OUT = 2 };
static const char *SPEC = "{\"layers\": [{\"type\": \"linear\", \"in\": 3, \"out\": 2},"
                          "{\"type\": \"linear\", \"in\": 2, \"out\": 2}]}";
static const float W1[HID * IN] = {0.5f, -1.0f, 0.25f, 1.5f, 0.75f, -0.5f};
static const float B1[HID] = {0.1f, -0.2f};
static const float W2[OUT * HID] = {1.0f, -0.5f, 0.25f, 2.0f};
static const float B2[OUT] = {0.3f, 0.0f};

static rp_model *model_with_known_weights(void) {
    static const int32_t plan[] = {1, 1};
    rp_model *m = ts_model(SPEC, 1, 2, plan, 2);
    ts_set_master(m, 0, W1, HID * IN);
    ts_set_master(m, 1, B1, HID);
    ts_set_master(m, 2, W2, OUT * HID);
    ts_set_master(m, 3, B2, OUT);
    return m;
}

/* Expected gradients (W1, b1, W2, b2 concatenated) for inputs x and output gradients g. */
static void expected_grads(const float *x, const float *g, double *out) {
    memset(out, 0, sizeof(double) * (HID * IN + HID + OUT * HID + OUT));
    double *dw1 = out, *db1 = out + HID * IN, *dw2 = db1 + HID, *db2 = dw2 + OUT * HID;
    for (int r = 0; r < ROWS; ++r) {
        double h[HID], dh[HID] = {0};
        for (int j = 0; j < HID; ++j) {
            h[j] = B1[j];
            for (int i = 0; i < IN; ++i)
                h[j] += (double)W1[j * IN + i] * x[r * IN + i];
        }
        for (int k = 0; k < OUT; ++k) {
            double gk = g[r * OUT + k];
            db2[k] += gk;
            for (int j = 0; j < HID; ++j) {
                dw2[k * HID + j] += gk * h[j];
                dh[j] += (double)W2[k * HID + j] * gk;
            }
        }
        for (int j = 0; j < HID; ++j) {
            db1[j] += dh[j];
            for (int i = 0; i < IN; ++i)
                dw1[j * IN + i] += dh[j] * x[r * IN + i];
        }
    }
}

static void assert_grads(rp_model *m, const double *want) {
    TS_OK(rp_synchronize(m));
    ts_params *grads = ts_grads(m);
    size_t offset = 0;
    for (size_t p = 0; p < grads->count; ++p)
        for (int64_t i = 0; i < grads->numel[p]; ++i, ++offset) {
            double got = grads->data[p][i], w = want[offset];
            if (fabs(got - w) > 1e-5 * fmax(1.0, fabs(w)))
                fail_msg("%s[%lld]: %.8g, expected %.8g", grads->names[p], (long long)i, got, w);
        }
    ts_params_free(grads);
}

/* The gradients accumulated in `m` are the chain rule's for inputs x and output gradients g. */
static void assert_hand_computed_grads(rp_model *m, const float *x, const float *g) {
    double want[HID * IN + HID + OUT * HID + OUT];
    expected_grads(x, g, want);
    assert_grads(m, want);
}

/* The inputs x and output gradients g of every test, and the same as [ROWS, IN] and [ROWS, OUT]
 * tensors. */
typedef struct data {
    float x[ROWS * IN], g[ROWS * OUT];
    DLManagedTensor *in, *grad;
} data;

static void data_init(data *d) {
    ts_fill_uniform(d->x, ROWS * IN, 11, -1.0f, 1.0f);
    ts_fill_uniform(d->g, ROWS * OUT, 12, -1.0f, 1.0f);
    const int64_t xs[] = {ROWS, IN}, gs[] = {ROWS, OUT};
    d->in = ts_f32(2, xs, d->x);
    d->grad = ts_f32(2, gs, d->g);
}

static void data_free(data *d) {
    ts_free(d->in);
    ts_free(d->grad);
}

static void merged_outputs_back_propagate_to_the_hand_computed_gradients(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    data d;
    data_init(&d);
    rp_run_config *cfg = ts_config(3, 0);
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, cfg));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, outs));
    assert_int_equal(n, 1);
    /* Wrong shape, then wrong count: refused, and the forward's state is kept for a correct call. */
    const int64_t bad_shape[] = {ROWS - 1, OUT};
    DLManagedTensor *bad = ts_f32(2, bad_shape, d.g);
    TS_ERR(rp_backward(m, (const DLManagedTensor *const *)&bad, 1), RP_ERR_INVALID_ARGUMENT,
           "shape", NULL);
    const DLManagedTensor *two[2] = {d.grad, d.grad};
    TS_ERR(rp_backward(m, two, 2), RP_ERR_INVALID_ARGUMENT, "1 gradient", NULL);
    TS_OK(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1));
    assert_hand_computed_grads(m, d.x, d.g);
    /* Once per forward. */
    TS_ERR(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1), RP_ERR_STATE, "no forward",
           NULL);
    ts_free(bad);
    data_free(&d);
    rp_tensor_list_destroy(outs);
    rp_run_config_destroy(cfg);
    rp_model_destroy(m);
}

static void unmerged_outputs_take_one_gradient_per_microbatch(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    data d;
    data_init(&d);
    const int64_t piece[] = {ROWS / 2, OUT};
    rp_run_config *cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_merge_output(cfg, 0));
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, cfg));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, outs));
    assert_int_equal(n, 2);
    /* Microbatch 1 gets no gradient (NULL): only rows 0..2 count. */
    DLManagedTensor *g0 = ts_f32(2, piece, d.g);
    const DLManagedTensor *grads[2] = {g0, NULL};
    TS_OK(rp_backward(m, grads, 2));
    float g_first_half[ROWS * OUT];
    memcpy(g_first_half, d.g, sizeof d.g);
    for (int i = ROWS / 2 * OUT; i < ROWS * OUT; ++i)
        g_first_half[i] = 0.0f;
    assert_hand_computed_grads(m, d.x, g_first_half);
    data_free(&d);
    ts_free(g0);
    rp_tensor_list_destroy(outs);
    rp_run_config_destroy(cfg);
    rp_model_destroy(m);
}

static void a_step_between_forward_and_backward_is_refused(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    data d;
    data_init(&d);
    TS_ERR(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1), RP_ERR_STATE, "no forward",
           NULL);
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, NULL));
    rp_optimizer *sgd = NULL;
    TS_OK(rp_optimizer_create(&sgd, RP_OPTIMIZER_SGD));
    TS_OK(rp_step(m, sgd, 0));
    TS_ERR(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1), RP_ERR_STATE, "step", NULL);
    rp_optimizer_destroy(sgd);
    data_free(&d);
    rp_tensor_list_destroy(outs);
    rp_model_destroy(m);
}

/* dx = W1^T W2^T g per row, in double. */
static void expected_input_grad(const float *g, double *dx) {
    for (int r = 0; r < ROWS; ++r)
        for (int i = 0; i < IN; ++i) {
            double acc = 0;
            for (int j = 0; j < HID; ++j) {
                double dh = 0;
                for (int k = 0; k < OUT; ++k)
                    dh += (double)W2[k * HID + j] * g[r * OUT + k];
                acc += (double)W1[j * IN + i] * dh;
            }
            dx[r * IN + i] = acc;
        }
}

static void assert_close_f32(const DLTensor *t, const double *want, int64_t n, const char *what) {
    assert_int_equal(ts_numel(t), n);
    float *got = malloc(sizeof(float) * n);
    ts_read_f32(t, got);
    for (int64_t i = 0; i < n; ++i)
        if (fabs(got[i] - want[i]) > 1e-5 * fmax(1.0, fabs(want[i])))
            fail_msg("%s[%lld]: %.8g, expected %.8g", what, (long long)i, got[i], want[i]);
    free(got);
}

/* x.grad over 3 microbatches (the pieces put back in row order), beside the same parameter
 * gradients rp_backward gives; an integer input alongside gets no gradient (NULL). */
static void backward_input_grads_gives_the_hand_computed_x_grad(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    data d;
    data_init(&d);
    const int64_t ids_shape[] = {ROWS};
    const int64_t ids[ROWS] = {0, 1, 2, 3, 4, 5};
    DLManagedTensor *extra = ts_i64(1, ids_shape, ids);
    const DLManagedTensor *inputs[2] = {d.in, extra};
    rp_run_config *cfg = ts_config(3, 0);
    rp_tensor_list *outs = NULL, *dx = NULL;
    TS_OK(rp_forward_train(&outs, m, inputs, 2, cfg));
    TS_ERR(rp_backward_input_grads(NULL, m, (const DLManagedTensor *const *)&d.grad, 1),
           RP_ERR_INVALID_ARGUMENT, "out_input_grads");
    TS_OK(rp_backward_input_grads(&dx, m, (const DLManagedTensor *const *)&d.grad, 1));
    size_t n = 0;
    TS_OK(rp_tensor_list_size(&n, dx));
    assert_int_equal(n, 2);
    DLManagedTensor *dx0 = NULL, *dx1 = (DLManagedTensor *)1;
    TS_OK(rp_tensor_list_get(&dx0, dx, 0));
    TS_OK(rp_tensor_list_get(&dx1, dx, 1));
    assert_null(dx1);
    assert_int_equal(dx0->dl_tensor.ndim, 2);
    assert_true(dx0->dl_tensor.shape[0] == ROWS && dx0->dl_tensor.shape[1] == IN);
    double want_dx[ROWS * IN];
    expected_input_grad(d.g, want_dx);
    assert_close_f32(&dx0->dl_tensor, want_dx, ROWS * IN, "x.grad");
    assert_hand_computed_grads(m, d.x, d.g);
    ts_free(dx0);
    rp_tensor_list_destroy(dx);
    rp_tensor_list_destroy(outs);
    rp_run_config_destroy(cfg);
    data_free(&d);
    ts_free(extra);
    rp_model_destroy(m);
}

static rp_model *single_linear(const char *spec, const float *w, int64_t nw, const float *b,
                               int64_t nb) {
    rp_model *m = ts_model(spec, 1, 1, NULL, 0);
    ts_set_master(m, 0, w, nw);
    ts_set_master(m, 1, b, nb);
    return m;
}

/* Two models chained through gradients (A: x -> h, B: h -> y): B's input gradient is A's output
 * gradient, and together they give the gradients of the two-layer model above. */
static void two_models_chain_through_input_gradients(void **state) {
    (void)state;
    rp_model *a = single_linear("{\"layers\": [{\"type\": \"linear\", \"in\": 3, \"out\": 2}]}",
                                W1, HID * IN, B1, HID);
    rp_model *b = single_linear("{\"layers\": [{\"type\": \"linear\", \"in\": 2, \"out\": 2}]}",
                                W2, OUT * HID, B2, OUT);
    data d;
    data_init(&d);
    rp_run_config *cfg = ts_config(2, 0);
    rp_tensor_list *h = NULL, *y = NULL, *dh = NULL, *dx = NULL;
    TS_OK(rp_forward_train(&h, a, (const DLManagedTensor *const *)&d.in, 1, cfg));
    DLManagedTensor *h0 = NULL;
    TS_OK(rp_tensor_list_get(&h0, h, 0));
    TS_OK(rp_forward_train(&y, b, (const DLManagedTensor *const *)&h0, 1, cfg));
    TS_OK(rp_backward_input_grads(&dh, b, (const DLManagedTensor *const *)&d.grad, 1));
    DLManagedTensor *dh0 = NULL;
    TS_OK(rp_tensor_list_get(&dh0, dh, 0));
    TS_OK(rp_backward_input_grads(&dx, a, (const DLManagedTensor *const *)&dh0, 1));
    DLManagedTensor *dx0 = NULL;
    TS_OK(rp_tensor_list_get(&dx0, dx, 0));
    double want[HID * IN + HID + OUT * HID + OUT], want_dx[ROWS * IN];
    expected_grads(d.x, d.g, want);
    expected_input_grad(d.g, want_dx);
    assert_close_f32(&dx0->dl_tensor, want_dx, ROWS * IN, "x.grad");
    assert_grads(a, want);                /* dW1, db1 */
    assert_grads(b, want + HID * IN + HID); /* dW2, db2 */
    ts_free(h0);
    ts_free(dh0);
    ts_free(dx0);
    rp_tensor_list_destroy(h);
    rp_tensor_list_destroy(y);
    rp_tensor_list_destroy(dh);
    rp_tensor_list_destroy(dx);
    rp_run_config_destroy(cfg);
    data_free(&d);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* Rows split by a callback, as the default split would (two halves). */
static int32_t halves(DLManagedTensor **out_pieces, const DLManagedTensor *const *inputs,
                      size_t n_inputs, int32_t num_microbatch, void *user_data) {
    (void)user_data;
    (void)n_inputs;
    const DLTensor *t = &inputs[0]->dl_tensor;
    const int64_t rows = t->shape[0] / num_microbatch, cols = t->shape[1];
    float *all = malloc(sizeof(float) * ts_numel(t));
    ts_read_f32(t, all);
    for (int32_t m = 0; m < num_microbatch; ++m) {
        const int64_t shape[2] = {rows, cols};
        out_pieces[m] = ts_f32(2, shape, all + m * rows * cols);
    }
    free(all);
    return 0;
}

static void input_grads_after_a_split_callback_are_refused_and_the_forward_kept(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    data d;
    data_init(&d);
    rp_run_config *cfg = ts_config(2, 0);
    TS_OK(rp_run_config_set_split_callback(cfg, halves, NULL));
    rp_tensor_list *outs = NULL, *dx = NULL;
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, cfg));
    TS_ERR(rp_backward_input_grads(&dx, m, (const DLManagedTensor *const *)&d.grad, 1),
           RP_ERR_INVALID_ARGUMENT, "split callback");
    assert_null(dx);
    TS_OK(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1));
    assert_hand_computed_grads(m, d.x, d.g);
    rp_tensor_list_destroy(outs);
    rp_run_config_destroy(cfg);
    data_free(&d);
    rp_model_destroy(m);
}

typedef rp_status (*plan_query)(int32_t *, int32_t *, int32_t, const rp_model *);

/* rp_model_stage_plan or rp_model_backward_stage_plan reports `want`. */
static void assert_counts(plan_query query, rp_model *m, const int32_t *want, int32_t n) {
    int32_t got[8] = {0}, count = 0;
    TS_OK(query(got, &count, 8, m));
    assert_int_equal(count, n);
    for (int32_t s = 0; s < n; ++s)
        assert_int_equal(got[s], want[s]);
}

static void assert_plan(rp_model *m, const int32_t *want, int32_t n) {
    assert_counts(rp_model_stage_plan, m, want, n);
}

/* rp_model_set_stage_plan: the plan of a live model changes (one stage, then back to two) and
 * training on each gives the hand-computed gradients; bad plans, and a switch while a forward
 * awaits its backward, are refused with the plan unchanged; NULL returns to the planner. */
static void stage_plan_switches_at_runtime_and_gradients_stay_exact(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    const int32_t two[] = {1, 1}, one[] = {2}, zero[] = {0, 2}, three[] = {1, 1, 1};
    assert_plan(m, two, 2);
    TS_ERR(rp_model_set_stage_plan(m, zero, 2), RP_ERR_INVALID_ARGUMENT, "at least one");
    TS_ERR(rp_model_set_stage_plan(m, three, 3), RP_ERR_INVALID_ARGUMENT, "3 stages");
    TS_ERR(rp_model_set_stage_plan(m, NULL, 1), RP_ERR_INVALID_ARGUMENT, "NULL");
    TS_ERR(rp_model_set_stage_plan(NULL, one, 1), RP_ERR_INVALID_ARGUMENT, "model");
    assert_plan(m, two, 2);
    TS_OK(rp_model_set_stage_plan(m, one, 1));
    assert_plan(m, one, 1);

    data d;
    data_init(&d);
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, NULL));
    TS_ERR(rp_model_set_stage_plan(m, two, 2), RP_ERR_STATE, "backward");
    assert_plan(m, one, 1);
    TS_OK(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1));
    assert_hand_computed_grads(m, d.x, d.g);
    rp_tensor_list_destroy(outs);

    TS_OK(rp_zero_grad(m));
    TS_OK(rp_model_set_stage_plan(m, two, 2));
    assert_plan(m, two, 2);
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, NULL));
    TS_OK(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1));
    assert_hand_computed_grads(m, d.x, d.g);
    rp_tensor_list_destroy(outs);

    TS_OK(rp_model_set_stage_plan(m, NULL, 0)); /* the automatic planner: every layer covered */
    int32_t counts[8] = {0}, n = 0;
    TS_OK(rp_model_stage_plan(counts, &n, 8, m));
    int32_t total = 0;
    for (int32_t s = 0; s < n; ++s)
        total += counts[s];
    assert_int_equal(total, 2);
    data_free(&d);
    rp_model_destroy(m);
}

static void assert_backward_plan(rp_model *m, const int32_t *want, int32_t n) {
    assert_counts(rp_model_backward_stage_plan, m, want, n);
}

/* rp_model_set_backward_stage_plan: one forward stage of both layers, two backward stages (the
 * forward downloads the activation between the layers for the second layer's backward stage):
 * rp_forward_train + rp_backward give the hand-computed gradients. Refused without an explicit
 * forward plan, with bad counts, while a forward awaits its backward, and at a fused call whose
 * plans end differently (then nothing changed: the gradients stay those of the split call); a
 * new forward plan drops the backward one. */
static void asymmetric_backward_stages_give_the_hand_computed_gradients(void **state) {
    (void)state;
    rp_model *m = model_with_known_weights();
    const int32_t one[] = {2}, two[] = {1, 1}, zero[] = {0, 2};
    TS_OK(rp_model_set_stage_plan(m, NULL, 0));
    TS_ERR(rp_model_set_backward_stage_plan(m, two, 2), RP_ERR_STATE, "explicit forward");
    TS_OK(rp_model_set_stage_plan(m, one, 1));
    TS_ERR(rp_model_set_backward_stage_plan(m, zero, 2), RP_ERR_INVALID_ARGUMENT, "at least one");
    TS_ERR(rp_model_set_backward_stage_plan(m, NULL, 2), RP_ERR_INVALID_ARGUMENT, "NULL");
    TS_ERR(rp_model_set_backward_stage_plan(NULL, two, 2), RP_ERR_INVALID_ARGUMENT, "model");
    assert_backward_plan(m, one, 1);
    TS_OK(rp_model_set_backward_stage_plan(m, two, 2));
    assert_backward_plan(m, two, 2);
    assert_plan(m, one, 1);

    data d;
    data_init(&d);
    rp_run_config *cfg = ts_config(2, 0);
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_train(&outs, m, (const DLManagedTensor *const *)&d.in, 1, cfg));
    TS_ERR(rp_model_set_backward_stage_plan(m, NULL, 0), RP_ERR_STATE, "backward");
    TS_OK(rp_backward(m, (const DLManagedTensor *const *)&d.grad, 1));
    assert_hand_computed_grads(m, d.x, d.g);
    rp_tensor_list_destroy(outs);

    /* Fused: the forward's last stage (both layers) is not the backward's (layer 1 alone). */
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    double value = 0.0;
    TS_ERR(rp_forward_backward(&value, NULL, m, (const DLManagedTensor *const *)&d.in, 1, d.grad,
                               loss, cfg),
           RP_ERR_INVALID_ARGUMENT, "same stage");
    assert_hand_computed_grads(m, d.x, d.g);

    TS_OK(rp_model_set_stage_plan(m, two, 2));
    assert_backward_plan(m, two, 2); /* the forward stages again */
    TS_OK(rp_model_set_stage_plan(m, one, 1));
    assert_backward_plan(m, one, 1);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    data_free(&d);
    rp_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(merged_outputs_back_propagate_to_the_hand_computed_gradients),
        cmocka_unit_test(unmerged_outputs_take_one_gradient_per_microbatch),
        cmocka_unit_test(backward_input_grads_gives_the_hand_computed_x_grad),
        cmocka_unit_test(two_models_chain_through_input_gradients),
        cmocka_unit_test(input_grads_after_a_split_callback_are_refused_and_the_forward_kept),
        cmocka_unit_test(a_step_between_forward_and_backward_is_refused),
        cmocka_unit_test(stage_plan_switches_at_runtime_and_gradients_stay_exact),
        cmocka_unit_test(asymmetric_backward_stages_give_the_hand_computed_gradients),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
