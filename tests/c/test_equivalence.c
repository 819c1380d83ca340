/*
 * test_equivalence.c - the pipeline computes what plain libtorch computes.
 *
 * Each case builds a model through the C API and the independent reference
 * (reference/reference.cpp: full autograd, no stages, no recompute, torch::optim::AdamW) from
 * the same spec and the same initial weights, feeds both the same batches and compares, for
 * three synchronous AdamW iterations: the loss, the merged outputs, every accumulated gradient
 * and every weight after the step.
 *
 * The grid: num_microbatch {1,2,3,5} x recompute grain {stage, layer} x CPU devices {1,2,3}
 * x dropout {p=0.2, p=0} x plan {automatic, an explicit plan}. The explicit plans rotate
 * through symmetric ones and asymmetric ones (rp_model_set_backward_stage_plan: backward stages
 * that start inside forward stages, whose inputs the forward downloads from the middle of a
 * stage). 10 rows split into 3 or 5
 * microbatches gives unequal pieces (4,3,3), so the tensor_split rule is exercised too.
 *
 * Tolerances (fp32 everywhere; error = ||got - want|| / max(||want||, 1e-6)):
 *   - loss and outputs <= 1e-5: both sides evaluate the same fp32 expressions, possibly with
 *     different kernels, summation orders and thread splits; unit roundoff is 6e-8 and the
 *     model is 7 layers deep, so honest differences stay around 1e-6.
 *   - gradients and weights <= 1e-4: gradients add microbatch contributions in an order the
 *     engine chooses and go through recompute, layer norm backward divides by small variances,
 *     and AdamW's normalised update turns gradient errors into weight errors of about
 *     lr * relative error. Real bugs (wrong mask, stale weight, missing microbatch, a gradient
 *     counted twice) give errors of 1e-2 and more.
 *
 * With RP_TEST_DEVICE=cuda (ctest label gpu) the same cases run on CUDA devices, up to the
 * number of visible GPUs; the binary exits 77 (skipped) when there is none.
 */
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 10
#define IN 8
#define OUT 4

static const char *SPEC_DROPOUT = "{\"layers\": ["
                                  "{\"type\": \"linear\", \"in\": 8, \"out\": 16},"
                                  "{\"type\": \"layer_norm\", \"dim\": 16},"
                                  "{\"type\": \"gelu\"},"
                                  "{\"type\": \"dropout\", \"p\": 0.2},"
                                  "{\"type\": \"residual_mlp\", \"dim\": 16, \"hidden\": 32},"
                                  "{\"type\": \"tanh\"},"
                                  "{\"type\": \"linear\", \"in\": 16, \"out\": 4}]}";

static const char *SPEC_NO_DROPOUT = "{\"layers\": ["
                                     "{\"type\": \"linear\", \"in\": 8, \"out\": 16},"
                                     "{\"type\": \"layer_norm\", \"dim\": 16},"
                                     "{\"type\": \"gelu\"},"
                                     "{\"type\": \"dropout\", \"p\": 0.0},"
                                     "{\"type\": \"residual_mlp\", \"dim\": 16, \"hidden\": 32},"
                                     "{\"type\": \"tanh\"},"
                                     "{\"type\": \"linear\", \"in\": 16, \"out\": 4}]}";

#define NUM_LAYERS 7

static const int32_t PLAN_ONE_STAGE[] = {7};
static const int32_t PLAN_PER_LAYER[] = {1, 1, 1, 1, 1, 1, 1};
static const int32_t PLAN_UNEVEN[] = {2, 3, 2};
static const int32_t PLAN_TWO[] = {4, 3};
/* Backward plans for PLAN_UNEVEN and PLAN_TWO: the same last stage (the fused tail), the others
 * cut where the forward's are not (layers 1, 3, 4 and 1, 2). */
static const int32_t BACKWARD_UNEVEN[] = {1, 2, 1, 1, 2};
static const int32_t BACKWARD_TWO[] = {1, 1, 2, 3};

typedef struct plan_def {
    const int32_t *layers;
    size_t n;
    const int32_t *backward; /* NULL: the forward stages */
    size_t n_backward;
    const char *name;
} plan_def;

#define NUM_PLANS 6
static const plan_def PLANS[NUM_PLANS] = {
    {PLAN_ONE_STAGE, 1, NULL, 0, "plan7"},
    {PLAN_UNEVEN, 3, BACKWARD_UNEVEN, 5, "plan232_backward12112"},
    {PLAN_PER_LAYER, 7, NULL, 0, "plan1x7"},
    {PLAN_TWO, 2, BACKWARD_TWO, 4, "plan43_backward1123"},
    {PLAN_UNEVEN, 3, NULL, 0, "plan232"},
    {PLAN_TWO, 2, NULL, 0, "plan43"},
};

typedef struct eq_case {
    int32_t num_microbatch;
    int32_t grain;
    int32_t devices;
    int dropout;
    const plan_def *plan; /* NULL: automatic planner */
    char name[128];
} eq_case;

static const double LR = 1e-2, B1 = 0.9, B2 = 0.999, EPS = 1e-8, WD = 1e-2;

static void assert_close(const char *what, int iteration, const float *got, const float *want,
                         int64_t n, double tol) {
    double e = ts_rel_err(got, want, n, 1e-6);
    if (!(e <= tol)) {
        print_error("iteration %d: %s relative error %.3g > %.1g\n", iteration, what, e, tol);
        fail();
    }
}

static void assert_loss_close(int iteration, double got, double want, double tol) {
    if (!(fabs(got - want) <= tol * fmax(fabs(want), 1e-6))) {
        print_error("iteration %d: loss %.10g, reference %.10g\n", iteration, got, want);
        fail();
    }
}

/* One fb on both sides with the same batch; compares loss, output and gradients. */
static void fb_both(rp_model *model, ref_model *ref, const rp_run_config *cfg, const rp_loss *loss,
                    int32_t loss_kind, double scale, int32_t nmb, const float *x,
                    const int64_t *x_shape, int32_t x_ndim, int x_int64, const void *y,
                    const int64_t *y_shape, int32_t y_ndim, int y_int64, int64_t call_index,
                    int iteration) {
    DLManagedTensor *in =
        x_int64 ? ts_i64(x_ndim, x_shape, (const int64_t *)x) : ts_f32(x_ndim, x_shape, x);
    DLManagedTensor *lab = NULL;
    if (y)
        lab = y_int64 ? ts_i64(y_ndim, y_shape, y) : ts_f32(y_ndim, y_shape, y);
    const DLManagedTensor *inputs[1] = {in};
    double got = 0.0, want = 0.0;
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward_backward(&got, &outs, model, inputs, 1, lab, loss, cfg));

    ref_tensor rin = {x, x_int64, x_ndim, x_shape};
    ref_tensor rlab = {y, y_int64, y_ndim, y_shape};
    ref_fb_args a = {rin, y ? &rlab : NULL, nmb, 0, 0, call_index, loss_kind, scale};
    float want_out[4096];
    int64_t want_n = 0;
    if (ref_forward_backward(ref, &want, want_out, 4096, &want_n, &a) != 0) {
        print_error("reference: %s\n", ref_last_error());
        fail();
    }
    assert_loss_close(iteration, got, want, 1e-5);

    size_t n_out = 0;
    TS_OK(rp_tensor_list_size(&n_out, outs));
    assert_int_equal(n_out, 1);
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    assert_int_equal(ts_numel(&o->dl_tensor), want_n);
    float *got_out = malloc(sizeof(float) * (size_t)want_n);
    ts_read_f32(&o->dl_tensor, got_out);
    assert_close("merged output", iteration, got_out, want_out, want_n, 1e-5);
    free(got_out);
    ts_free(o);
    rp_tensor_list_destroy(outs);

    ts_assert_grads_match(model, ref, 1e-4, "gradient");
    ts_free(in);
    ts_free(lab);
}

static void run_grid_case(void **state) {
    const eq_case *c = *state;
    const char *spec = c->dropout ? SPEC_DROPOUT : SPEC_NO_DROPOUT;
    uint64_t seed = 1000 + (uint64_t)c->num_microbatch * 7 + (uint64_t)c->devices;
    rp_model *model = ts_model(spec, seed, c->devices, c->plan ? c->plan->layers : NULL,
                               c->plan ? c->plan->n : 0);
    int32_t n = 0;
    TS_OK(rp_model_num_layers(&n, model));
    assert_int_equal(n, NUM_LAYERS);
    TS_OK(rp_model_num_devices(&n, model));
    assert_int_equal(n, c->devices);
    if (c->plan) {
        TS_OK(rp_model_num_stages(&n, model));
        assert_int_equal(n, (int32_t)c->plan->n);
    }
    if (c->plan && c->plan->backward) {
        TS_OK(rp_model_set_backward_stage_plan(model, c->plan->backward, c->plan->n_backward));
        int32_t got[8] = {0};
        TS_OK(rp_model_backward_stage_plan(got, &n, 8, model));
        assert_int_equal(n, (int32_t)c->plan->n_backward);
        for (size_t b = 0; b < c->plan->n_backward; ++b)
            assert_int_equal(got[b], c->plan->backward[b]);
    }
    ref_model *ref = ts_reference_from(model, spec, seed);
    rp_run_config *cfg = ts_config(c->num_microbatch, c->grain);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    double scale = 1.0 / c->num_microbatch;
    TS_OK(rp_loss_set_scale(loss, scale));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, LR));
    TS_OK(rp_optimizer_set_betas(opt, B1, B2));
    TS_OK(rp_optimizer_set_eps(opt, EPS));
    TS_OK(rp_optimizer_set_weight_decay(opt, WD));

    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    for (int it = 0; it < 3; ++it) {
        float x[ROWS * IN], y[ROWS * OUT];
        ts_fill_uniform(x, ROWS * IN, 100 + it, -2.f, 2.f);
        ts_fill_uniform(y, ROWS * OUT, 200 + it, -1.f, 1.f);
        fb_both(model, ref, cfg, loss, REF_LOSS_MSE, scale, c->num_microbatch, x, xs, 2, 0, y, ys,
                2, 0, it, it);
        TS_OK(rp_step(model, opt, 0));
        assert_int_equal(ref_step_adamw(ref, LR, B1, B2, EPS, WD), 0);
        ts_assert_masters_match(model, ref, 1e-4, "weight after AdamW step");
    }
    int64_t steps = 0;
    TS_OK(rp_model_step_count(&steps, model));
    assert_int_equal(steps, 3);
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ref_destroy(ref);
    rp_model_destroy(model);
}

/* Every other layer type and its options, cross entropy, and SGD with momentum and weight
 * decay against torch::optim::SGD. */
static void layer_zoo_with_cross_entropy_and_sgd_matches_reference(void **state) {
    (void)state;
    const char *spec =
        "{\"layers\": ["
        "{\"type\": \"linear\", \"in\": 6, \"out\": 12},"
        "{\"type\": \"rms_norm\", \"dim\": 12},"
        "{\"type\": \"silu\"},"
        "{\"type\": \"residual_mlp\", \"dim\": 12, \"hidden\": 20, \"activation\": \"silu\","
        " \"norm\": \"rms_norm\"},"
        "{\"type\": \"relu\"},"
        "{\"type\": \"residual_mlp\", \"dim\": 12, \"hidden\": 8, \"activation\": \"tanh\","
        " \"norm\": \"none\"},"
        "{\"type\": \"gelu\", \"approximate\": \"tanh\"},"
        "{\"type\": \"residual_mlp\", \"dim\": 12, \"hidden\": 6, \"activation\": \"relu\","
        " \"eps\": 0.001},"
        "{\"type\": \"reshape\", \"shape\": [3, -1]},"
        "{\"type\": \"layer_norm\", \"dim\": 4, \"eps\": 0.0001},"
        "{\"type\": \"flatten\"},"
        "{\"type\": \"dropout\", \"p\": 0.5},"
        "{\"type\": \"linear\", \"in\": 12, \"out\": 5, \"bias\": false}]}";
    rp_model *model = ts_model(spec, 77, 2, NULL, 0);
    ref_model *ref = ts_reference_from(model, spec, 77);
    rp_run_config *cfg = ts_config(3, RP_GRAIN_LAYER);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_CROSS_ENTROPY));
    TS_OK(rp_loss_set_scale(loss, 0.5));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(opt, 0.05));
    TS_OK(rp_optimizer_set_momentum(opt, 0.9));
    TS_OK(rp_optimizer_set_weight_decay(opt, 0.01));
    int64_t xs[2] = {ROWS, 6}, ys[1] = {ROWS};
    for (int it = 0; it < 3; ++it) {
        float x[ROWS * 6];
        int64_t y[ROWS];
        ts_fill_uniform(x, ROWS * 6, 300 + it, -2.f, 2.f);
        for (int r = 0; r < ROWS; ++r)
            y[r] = (r * 3 + it) % 5;
        fb_both(model, ref, cfg, loss, REF_LOSS_CROSS_ENTROPY, 0.5, 3, x, xs, 2, 0, y, ys, 1, 1, it,
                it);
        TS_OK(rp_step(model, opt, 0));
        assert_int_equal(ref_step_sgd(ref, 0.05, 0.9, 0.01), 0);
        ts_assert_masters_match(model, ref, 1e-4, "weight after SGD step");
    }
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ref_destroy(ref);
    rp_model_destroy(model);
}

/* An embedding model against the reference over two AdamW steps of `calls_per_step` training
 * calls each; `index` gives input i of a step's call. */
typedef struct embedding_case {
    const char *spec;
    uint64_t seed;
    int32_t devices, num_microbatch;
    int calls_per_step;
    double grad_scale; /* the model's loss scaler; 0: off */
    uint64_t label_seed;
    int64_t (*index)(int i, int step, int call);
    const char *what;
} embedding_case;

static void run_embedding_case(const embedding_case *c) {
    rp_model *model = ts_model(c->spec, c->seed, c->devices, NULL, 0);
    if (c->grad_scale > 0)
        TS_OK(rp_model_set_grad_scaler(model, c->grad_scale, 1000));
    ref_model *ref = ts_reference_from(model, c->spec, c->seed);
    rp_run_config *cfg = ts_config(c->num_microbatch, RP_GRAIN_STAGE);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    int64_t xs[2] = {ROWS, 3}, ys[2] = {ROWS, 4};
    for (int step = 0; step < 2; ++step) {
        for (int call = 0; call < c->calls_per_step; ++call) {
            const int k = step * c->calls_per_step + call;
            int64_t idx[ROWS * 3];
            for (int i = 0; i < ROWS * 3; ++i)
                idx[i] = c->index(i, step, call);
            float y[ROWS * 4];
            ts_fill_uniform(y, ROWS * 4, c->label_seed + (uint64_t)k, -1.f, 1.f);
            fb_both(model, ref, cfg, loss, REF_LOSS_MSE, 1.0, c->num_microbatch,
                    (const float *)idx, xs, 2, 1, y, ys, 2, 0, k, step);
        }
        TS_OK(rp_step(model, opt, 0));
        assert_int_equal(ref_step_adamw(ref, 1e-3, 0.9, 0.999, 1e-8, 1e-2), 0);
        ts_assert_masters_match(model, ref, 1e-4, c->what);
    }
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ref_destroy(ref);
    rp_model_destroy(model);
}

static int64_t index_below_10(int i, int step, int call) {
    (void)call;
    return (i * 7 + step) % 10; /* row 10 never used */
}

/* int64 inputs through an embedding; gradient rows of unused indices stay zero. The call's 30
 * indices outnumber the 11 rows, so the gradient stays dense (embedding_row_gradient). */
static void embedding_model_matches_reference(void **state) {
    (void)state;
    const embedding_case c = {"{\"layers\": ["
                              "{\"type\": \"embedding\", \"num\": 11, \"dim\": 8},"
                              "{\"type\": \"layer_norm\", \"dim\": 8},"
                              "{\"type\": \"flatten\", \"start_dim\": 1},"
                              "{\"type\": \"linear\", \"in\": 24, \"out\": 4}]}",
                              5, 3, 4, 1, 0.0, 400, index_below_10,
                              "weight after AdamW step (defaults)"};
    run_embedding_case(&c);
}

static int64_t index_repeating(int i, int step, int call) {
    return (i * 5 + 3 * call + step) % (call ? 23 : 7); /* repeats; rows 23.. unused */
}

/* The embedding's gradient as rows (embedding_row_gradient: the call's 30 indices, fewer than the
 * 97 rows, so only the rows its tokens used reach the host), added into a buffer that already
 * holds the previous call's gradient (a call's contributions are then held until it succeeds)
 * and unscaled by the loss scaler's factor. Two calls per step, indices repeating within a call
 * and differing between the calls, loss scale 8 (a power of two: the unscaled gradient is the
 * same fp32 arithmetic). Checked to fail when the factor is dropped or the held call's rows
 * are skipped. */
static void embedding_rows_accumulate_over_calls_with_loss_scaling(void **state) {
    (void)state;
    const embedding_case c = {"{\"layers\": ["
                              "{\"type\": \"embedding\", \"num\": 97, \"dim\": 8},"
                              "{\"type\": \"tanh\"},"
                              "{\"type\": \"flatten\", \"start_dim\": 1},"
                              "{\"type\": \"linear\", \"in\": 24, \"out\": 4}]}",
                              6, 2, 3, 2, 8.0, 500, index_repeating,
                              "weight after AdamW step (two calls, loss scale 8)"};
    run_embedding_case(&c);
}

/* RP_LOSS_OUTPUT: the model's one-element output per microbatch is the loss. */
static void output_loss_matches_reference(void **state) {
    (void)state;
    const char *spec = "{\"layers\": ["
                       "{\"type\": \"linear\", \"in\": 5, \"out\": 7},"
                       "{\"type\": \"tanh\"},"
                       "{\"type\": \"linear\", \"in\": 7, \"out\": 1}]}";
    rp_model *model = ts_model(spec, 9, 2, NULL, 0);
    ref_model *ref = ts_reference_from(model, spec, 9);
    rp_run_config *cfg = ts_config(3, 0);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_OUTPUT));
    TS_OK(rp_loss_set_scale(loss, 0.25));
    int64_t xs[2] = {3, 5};
    float x[15];
    ts_fill_uniform(x, 15, 500, -1.f, 1.f);
    fb_both(model, ref, cfg, loss, REF_LOSS_OUTPUT, 0.25, 3, x, xs, 2, 0, NULL, NULL, 0, 0, 0, 0);
    /* NULL loss means RP_LOSS_OUTPUT with scale 1. */
    fb_both(model, ref, cfg, NULL, REF_LOSS_OUTPUT, 1.0, 3, x, xs, 2, 0, NULL, NULL, 0, 0, 1, 1);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ref_destroy(ref);
    rp_model_destroy(model);
}

/* rp_forward runs in evaluation mode (dropout is the identity), and does not count as a
 * training call for the dropout masks: the training call after it still uses k = 1. */
static void forward_is_eval_mode_and_not_a_training_call(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC_DROPOUT, 31, 2, NULL, 0);
    ref_model *ref = ts_reference_from(model, SPEC_DROPOUT, 31);
    rp_run_config *cfg = ts_config(2, 0);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    float x[ROWS * IN], y[ROWS * OUT];
    ts_fill_uniform(x, ROWS * IN, 600, -2.f, 2.f);
    ts_fill_uniform(y, ROWS * OUT, 601, -1.f, 1.f);
    fb_both(model, ref, cfg, loss, REF_LOSS_MSE, 1.0, 2, x, xs, 2, 0, y, ys, 2, 0, 0, 0);

    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, model, inputs, 1, cfg));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    float got[ROWS * OUT], want[ROWS * OUT];
    int64_t n = 0;
    ref_tensor rin = {x, 0, 2, xs};
    assert_int_equal(ref_forward(ref, want, ROWS * OUT, &n, &rin, 2), 0);
    assert_int_equal(n, ROWS * OUT);
    assert_int_equal(ts_numel(&o->dl_tensor), n);
    assert_int_equal(o->dl_tensor.ndim, 2);
    assert_int_equal(o->dl_tensor.shape[0], ROWS);
    assert_int_equal(o->dl_tensor.shape[1], OUT);
    ts_read_f32(&o->dl_tensor, got);
    assert_close("eval output", 0, got, want, n, 1e-5);
    ts_free(o);
    rp_tensor_list_destroy(outs);
    ts_free(in);

    fb_both(model, ref, cfg, loss, REF_LOSS_MSE, 1.0, 2, x, xs, 2, 0, y, ys, 2, 0, 1, 1);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ref_destroy(ref);
    rp_model_destroy(model);
}

/* Model dtype bf16 / f16: the devices compute with rounded weights and activations while the
 * reference stays fp32. bf16 keeps 8 significant bits (unit roundoff 3.9e-3), f16 11 bits
 * (4.9e-4); through 7 layers the gradients were seen to agree to 9e-3 (bf16) / 9e-4 (f16),
 * so the tolerances are about three times that: loss 3e-2 / 4e-3, gradients 3e-2 / 4e-3. SGD
 * (not AdamW, whose sign-like first step would amplify the rounding of near-zero gradients)
 * keeps the fp32 master weights within 1e-2 / 2e-3 (a zero-initialised bias is all update, so
 * its relative error is that of its gradient). */
static void reduced_precision_model_dtype_tracks_the_fp32_reference(void **state) {
    (void)state;
    static const struct {
        int32_t dtype;
        const char *name;
        double loss_tol, grad_tol, weight_tol;
    } kinds[] = {{RP_DTYPE_BF16, "bf16", 3e-2, 3e-2, 1e-2},
                 {RP_DTYPE_F16, "f16", 4e-3, 4e-3, 2e-3}};
    int32_t devices = ts_devices(2);
    for (size_t k = 0; k < 2; ++k) {
        rp_model_options *o = NULL;
        TS_OK(rp_model_options_create(&o));
        TS_OK(rp_model_options_set_seed(o, 71));
        TS_OK(rp_model_options_set_devices(o, ts_device_kind(), devices));
        TS_OK(rp_model_options_set_model_dtype(o, kinds[k].dtype));
        rp_model *model = NULL;
        TS_OK(rp_model_create(&model, SPEC_NO_DROPOUT, o));
        rp_model_options_destroy(o);
        ref_model *ref = ts_reference_from(model, SPEC_NO_DROPOUT, 71);
        rp_run_config *cfg = ts_config(2, 0);
        rp_loss *loss = NULL;
        TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
        rp_optimizer *opt = NULL;
        TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
        TS_OK(rp_optimizer_set_learning_rate(opt, 0.05));
        int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
        for (int it = 0; it < 2; ++it) {
            float x[ROWS * IN], y[ROWS * OUT];
            ts_fill_uniform(x, ROWS * IN, 700 + it, -2.f, 2.f);
            ts_fill_uniform(y, ROWS * OUT, 800 + it, -1.f, 1.f);
            DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
            const DLManagedTensor *inputs[1] = {in};
            double got = 0, want = 0;
            TS_OK(rp_forward_backward(&got, NULL, model, inputs, 1, lab, loss, cfg));
            ref_tensor rin = {x, 0, 2, xs}, rlab = {y, 0, 2, ys};
            ref_fb_args a = {rin, &rlab, 2, 0, 0, it, REF_LOSS_MSE, 1.0};
            assert_int_equal(ref_forward_backward(ref, &want, NULL, 0, NULL, &a), 0);
            if (!(fabs(got - want) <= kinds[k].loss_tol * fabs(want))) {
                print_error("%s: loss %.6g, fp32 reference %.6g\n", kinds[k].name, got, want);
                fail();
            }
            ts_assert_grads_match(model, ref, kinds[k].grad_tol, kinds[k].name);
            TS_OK(rp_step(model, opt, 0));
            assert_int_equal(ref_step_sgd(ref, 0.05, 0, 0), 0);
            ts_assert_masters_match(model, ref, kinds[k].weight_tol, kinds[k].name);
            ts_free(in);
            ts_free(lab);
        }
        rp_optimizer_destroy(opt);
        rp_loss_destroy(loss);
        rp_run_config_destroy(cfg);
        ref_destroy(ref);
        rp_model_destroy(model);
    }
}

static int device_count_or_skip(void) {
    if (ts_device_kind() != RP_DEVICE_CUDA)
        return 3;
    int32_t gpus = 0;
    if (rp_cuda_device_count(&gpus) != RP_OK || gpus == 0) {
        printf("no CUDA device visible: skipping\n");
        exit(77);
    }
    return gpus < 3 ? gpus : 3;
}

int main(void) {
    int max_devices = device_count_or_skip();
    static const int32_t NMB[] = {1, 2, 3, 5};
    static const int32_t GRAINS[] = {RP_GRAIN_STAGE, RP_GRAIN_LAYER};
    enum { MAX_CASES = 4 * 2 * 3 * 2 * 2 };
    static eq_case cases[MAX_CASES];
    static struct CMUnitTest tests[MAX_CASES + 8];
    size_t n = 0, rotation = 0;
    for (size_t a = 0; a < 4; ++a)
        for (size_t g = 0; g < 2; ++g)
            for (int32_t d = 1; d <= max_devices; ++d)
                for (int drop = 1; drop >= 0; --drop)
                    for (int explicit_plan = 0; explicit_plan < 2; ++explicit_plan) {
                        eq_case *c = &cases[n];
                        c->num_microbatch = NMB[a];
                        c->grain = GRAINS[g];
                        c->devices = d;
                        c->dropout = drop;
                        /* + a + g: rotation alone would tie each plan to a (devices,
                         * dropout) pair, the inner loops being 6 long. */
                        c->plan =
                            explicit_plan ? &PLANS[(rotation++ + a + g) % NUM_PLANS] : NULL;
                        snprintf(
                            c->name, sizeof c->name, "matches_reference_mb%d_%s_devices%d_%s_%s",
                            c->num_microbatch, c->grain == RP_GRAIN_STAGE ? "stage" : "layer", d,
                            drop ? "dropout" : "nodropout", c->plan ? c->plan->name : "autoplan");
                        tests[n] = (struct CMUnitTest){c->name, run_grid_case, NULL, NULL, c};
                        ++n;
                    }
    tests[n++] =
        (struct CMUnitTest)cmocka_unit_test(layer_zoo_with_cross_entropy_and_sgd_matches_reference);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(embedding_model_matches_reference);
    tests[n++] =
        (struct CMUnitTest)cmocka_unit_test(embedding_rows_accumulate_over_calls_with_loss_scaling);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(output_loss_matches_reference);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(forward_is_eval_mode_and_not_a_training_call);
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(
        reduced_precision_model_dtype_tracks_the_fp32_reference);
    return _cmocka_run_group_tests("equivalence", tests, n, NULL, NULL);
}
