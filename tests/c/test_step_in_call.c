/*
 * test_step_in_call.c - steps inside the training calls (rp_model_set_step_in_call,
 * docs/semantics.md "Steps inside the training calls").
 *
 * What the setting promises, each checked against something independent of it:
 *  - the weights are bit for bit those of rp_forward_backward + rp_step (the same kernel, the
 *    same stochastic-rounding streams), over several stages, microbatches, both recompute grains
 *    and fp32 and bf16 models; the explicit path is itself checked against torch::optim::AdamW in
 *    test_memory_saving.c, and the in-call weights are checked against it here too;
 *  - explicit steps, the standard mode, loss scaling and pending gradients are refused with
 *    nothing changed;
 *  - a nan loss leaves every weight alone and is counted; training goes on afterwards;
 *  - a call that fails before any gradient is final (a failing loss callback) leaves no trace;
 *    one that fails in a backward stage keeps exactly the updates of the parameters whose
 *    gradients were final (bitwise those of a whole call and an explicit step) and leaves the
 *    others at their old values, every gradient zero;
 *  - an embedding's rows, sent after every microbatch, all reach the table's update (only the
 *    last microbatch's make its gradient final), bit for bit as with explicit steps.
 */
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS = 12, IN = 6, OUT = 3 }; /* IN and OUT: TS_MLP_SPEC's widths */

/* A model of `spec` in host memory `mode` with `dtype`, its `n_stages` stages as `plan` says. */
static rp_model *staged_model(const char *spec, int32_t mode, int32_t dtype, uint64_t seed,
                              int32_t devices, const int32_t *plan, size_t n_stages) {
    rp_model_options *o = ts_options(seed, devices);
    TS_OK(rp_model_options_set_model_dtype(o, dtype));
    TS_OK(rp_model_options_set_host_memory_mode(o, mode));
    TS_OK(rp_model_options_set_stage_plan(o, plan, n_stages));
    return ts_model_with_options(spec, o);
}

static rp_model *make_model(int32_t mode, int32_t dtype, uint64_t seed) {
    /* Four stages, so the step arrives in several parts while the call goes on. */
    static const int32_t plan[4] = {2, 2, 2, 1};
    return staged_model(TS_MLP_SPEC, mode, dtype, seed, 3, plan, 4);
}

typedef struct batch {
    float x[ROWS * IN], y[ROWS * OUT];
    DLManagedTensor *in, *lab;
} batch;

static void batch_init(batch *b, int k) {
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    ts_fill_uniform(b->x, ROWS * IN, 500 + k, -1.f, 1.f);
    ts_fill_uniform(b->y, ROWS * OUT, 900 + k, -1.f, 1.f);
    b->in = ts_f32(2, xs, b->x);
    b->lab = ts_f32(2, ys, b->y);
}

static void batch_free(batch *b) {
    ts_free(b->in);
    ts_free(b->lab);
}

static rp_status train_call(double *out_loss, rp_model *m, const batch *b, const rp_loss *loss,
                            const rp_run_config *cfg) {
    const DLManagedTensor *inputs[1] = {b->in};
    return rp_forward_backward(out_loss, NULL, m, inputs, 1, b->lab, loss, cfg);
}

/* The master weights once `m`'s steps are done; frees what the training used. */
static ts_params *masters_after_training(rp_model *m, rp_optimizer *opt, rp_run_config *cfg,
                                         rp_loss *loss) {
    TS_OK(rp_synchronize(m));
    ts_params *w = ts_masters(m);
    rp_optimizer_destroy(opt);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    rp_model_destroy(m);
    return w;
}

/* What a training run over `m` uses: an MSE loss, `microbatches` at `grain`, AdamW (lr 1e-2)
 * stepping inside the calls when `in_call` (else the caller steps). */
typedef struct training {
    rp_loss *loss;
    rp_run_config *cfg;
    rp_optimizer *opt;
} training;

static training start_training(rp_model *m, int in_call, int32_t microbatches, int32_t grain) {
    training t = {NULL, NULL, NULL};
    TS_OK(rp_loss_create(&t.loss, RP_LOSS_MSE));
    t.cfg = ts_config(microbatches, grain);
    t.opt = ts_adamw(1e-2);
    if (in_call)
        TS_OK(rp_model_set_step_in_call(m, t.opt));
    return t;
}

/* Five calls on five batches, stepping inside the calls or with rp_step after each. */
static ts_params *train_five(int in_call, int32_t dtype, int32_t grain, int32_t microbatches,
                             double *losses) {
    rp_model *m = make_model(RP_HOST_MEMORY_SAVING, dtype, 17);
    training t = start_training(m, in_call, microbatches, grain);
    for (int it = 0; it < 5; ++it) {
        batch b;
        batch_init(&b, it);
        TS_OK(train_call(&losses[it], m, &b, t.loss, t.cfg));
        if (!in_call)
            TS_OK(rp_step(m, t.opt, 1));
        batch_free(&b);
    }
    return masters_after_training(m, t.opt, t.cfg, t.loss);
}

static void in_call_steps_give_bitwise_the_weights_of_explicit_steps(void **state) {
    (void)state;
    const int32_t dtypes[2] = {RP_DTYPE_F32, RP_DTYPE_BF16};
    const int32_t grains[2] = {RP_GRAIN_STAGE, RP_GRAIN_LAYER};
    const int32_t microbatches[2] = {1, 3};
    for (int d = 0; d < 2; ++d)
        for (int g = 0; g < 2; ++g)
            for (int k = 0; k < 2; ++k) {
                double explicit_losses[5], in_call_losses[5];
                ts_params *want = train_five(0, dtypes[d], grains[g], microbatches[k],
                                             explicit_losses);
                ts_params *got = train_five(1, dtypes[d], grains[g], microbatches[k],
                                            in_call_losses);
                ts_assert_params_equal(got, want);
                for (int it = 0; it < 5; ++it)
                    assert_true(in_call_losses[it] == explicit_losses[it]);
                /* The steps did something: the loss moved over the five calls (on different
                 * batches, so compare the trained weights with the initial ones instead). */
                rp_model *fresh = make_model(RP_HOST_MEMORY_SAVING, dtypes[d], 17);
                ts_params *initial = ts_masters(fresh);
                assert_true(ts_rel_err(got->data[0], initial->data[0], got->numel[0], 1e-30) >
                            1e-3);
                ts_params_free(initial);
                rp_model_destroy(fresh);
                ts_params_free(want);
                ts_params_free(got);
            }
}

/* fp32 model, three calls with in-call AdamW steps against torch::optim::AdamW. Bounds as in
 * test_memory_saving.c: the first step computes from the fp32 moments it just formed (1e-5);
 * later ones read moments rounded to bf16 (2^-7 relative), each step moving a weight by at most
 * lr * 1.012, so three steps stay within 3 * lr * 0.012 = 3.6e-4 plus what those differences do
 * to the gradients: bound 1e-3. */
static void in_call_steps_follow_torch_adamw_within_bf16_moments(void **state) {
    (void)state;
    const double lr = 1e-2;
    rp_model *m = make_model(RP_HOST_MEMORY_SAVING, RP_DTYPE_F32, 23);
    ref_model *ref = ts_reference_from(m, TS_MLP_SPEC, 23);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    rp_optimizer *opt = ts_adamw(lr);
    TS_OK(rp_model_set_step_in_call(m, opt));
    int32_t on = 0;
    TS_OK(rp_model_step_in_call(&on, m));
    assert_int_equal(on, 1);
    for (int it = 0; it < 3; ++it) {
        batch b;
        batch_init(&b, it);
        double got = 0.0;
        TS_OK(train_call(&got, m, &b, loss, cfg));
        double want = ts_ref_mse_call(ref, b.x, b.y, ROWS, IN, OUT, 2, it);
        ts_assert_loss_close(got, want, it < 2 ? 1e-5 : 1e-2, it);
        assert_int_equal(ref_step_adamw(ref, lr, 0.9, 0.999, 1e-8, 1e-2), 0);
        TS_OK(rp_synchronize(m));
        ts_assert_masters_follow_bf16_state(m, ref, it, "weights after the first in-call step");
        batch_free(&b);
    }
    rp_optimizer_destroy(opt);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ref_destroy(ref);
    rp_model_destroy(m);
}

static void what_cannot_hold_is_refused_with_nothing_changed(void **state) {
    (void)state;
    rp_optimizer *opt = ts_adamw(1e-2);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    batch b;
    batch_init(&b, 0);
    int32_t on = -1;

    /* The standard mode: its asynchronous steps already overlap a whole call. */
    rp_model *std_model = make_model(RP_HOST_MEMORY_STANDARD, RP_DTYPE_F32, 3);
    TS_ERR(rp_model_set_step_in_call(std_model, opt), RP_ERR_STATE, "RP_HOST_MEMORY_SAVING");
    TS_OK(rp_model_step_in_call(&on, std_model));
    assert_int_equal(on, 0);
    rp_model_destroy(std_model);

    /* fp16: loss scaling is on by default, and its rule needs every gradient first. */
    rp_model *half = make_model(RP_HOST_MEMORY_SAVING, RP_DTYPE_F16, 3);
    TS_ERR(rp_model_set_step_in_call(half, opt), RP_ERR_STATE, "loss scaling");
    rp_model_destroy(half);

    rp_model *m = make_model(RP_HOST_MEMORY_SAVING, RP_DTYPE_F32, 3);
    /* Gradients waiting for a step. */
    double l = 0.0;
    TS_OK(train_call(&l, m, &b, loss, cfg));
    TS_OK(rp_synchronize(m));
    ts_params *grads = ts_grads(m), *weights = ts_masters(m);
    TS_ERR(rp_model_set_step_in_call(m, opt), RP_ERR_STATE, "rp_zero_grad");
    TS_OK(rp_model_step_in_call(&on, m));
    assert_int_equal(on, 0);
    ts_params *grads_after = ts_grads(m), *weights_after = ts_masters(m);
    ts_assert_params_equal(grads_after, grads);
    ts_assert_params_equal(weights_after, weights);
    ts_params_free(grads_after);
    ts_params_free(weights_after);

    /* Explicit steps while on; then off again, and rp_step works. */
    TS_OK(rp_zero_grad(m));
    TS_OK(rp_model_set_step_in_call(m, opt));
    TS_ERR(rp_step(m, opt, 1), RP_ERR_STATE, "rp_model_set_step_in_call");
    TS_ERR(rp_model_set_grad_scaler(m, 1024.0, 100), RP_ERR_STATE, "in-call");
    ts_params *untouched = ts_masters(m);
    ts_assert_params_equal(untouched, weights);
    ts_params_free(untouched);
    TS_OK(rp_model_set_step_in_call(m, NULL));
    TS_OK(rp_model_step_in_call(&on, m));
    assert_int_equal(on, 0);
    TS_OK(train_call(&l, m, &b, loss, cfg));
    TS_OK(rp_step(m, opt, 0));
    ts_params *stepped = ts_masters(m);
    assert_true(ts_rel_err(stepped->data[0], weights->data[0], weights->numel[0], 1e-30) > 1e-4);
    ts_params_free(stepped);
    TS_ERR(rp_model_set_step_in_call(NULL, opt), RP_ERR_INVALID_ARGUMENT, "null");
    TS_ERR(rp_model_step_in_call(NULL, m), RP_ERR_INVALID_ARGUMENT, "null");

    ts_params_free(grads);
    ts_params_free(weights);
    rp_model_destroy(m);
    batch_free(&b);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    rp_optimizer_destroy(opt);
}

/* The model `m` (seed `seed`, stepping inside its calls, weights untouched since creation) trains
 * on `b` like a fresh model of the same seed with an explicit step: bit for bit. */
static void assert_next_call_steps_like_a_fresh_model(rp_model *m, uint64_t seed, const batch *b,
                                                      const rp_loss *loss,
                                                      const rp_run_config *cfg,
                                                      const rp_optimizer *opt) {
    double l = 0.0;
    rp_model *fresh = make_model(RP_HOST_MEMORY_SAVING, RP_DTYPE_F32, seed);
    TS_OK(train_call(&l, fresh, b, loss, cfg));
    TS_OK(rp_step(fresh, opt, 0));
    TS_OK(train_call(&l, m, b, loss, cfg));
    assert_true(isfinite(l));
    TS_OK(rp_synchronize(m));
    ts_params *trained = ts_masters(m), *want = ts_masters(fresh);
    ts_assert_params_equal(trained, want);
    ts_params_free(trained);
    ts_params_free(want);
    rp_model_destroy(fresh);
}

static void a_nan_loss_leaves_the_weights_alone(void **state) {
    (void)state;
    rp_model *m = make_model(RP_HOST_MEMORY_SAVING, RP_DTYPE_F32, 29);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    rp_optimizer *opt = ts_adamw(1e-2);
    TS_OK(rp_model_set_step_in_call(m, opt));
    ts_params *before = ts_masters(m);
    batch b;
    batch_init(&b, 1);
    float *labels = b.lab->dl_tensor.data; /* ts_f32 copied b.y: write the tensor itself */
    labels[5] = NAN;
    double l = 0.0;
    TS_OK(train_call(&l, m, &b, loss, cfg));
    assert_true(isnan(l));
    TS_OK(rp_synchronize(m));
    ts_params *after = ts_masters(m);
    ts_assert_params_equal(after, before);
    int64_t nan_losses = 0, skipped = 0;
    TS_OK(rp_model_nonfinite_counts(&nan_losses, &skipped, m));
    assert_int_equal(nan_losses, 1);
    assert_int_equal(skipped, 1);
    /* The dropped gradients are gone: the next finite call trains from clean buffers, like a
     * fresh model given the same weights (AdamW's first step: moments from this call only). */
    labels[5] = 0.25f;
    assert_next_call_steps_like_a_fresh_model(m, 29, &b, loss, cfg, opt);
    ts_params_free(before);
    ts_params_free(after);
    batch_free(&b);
    rp_optimizer_destroy(opt);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    rp_model_destroy(m);
}

static int32_t failing_loss(double *out_loss, DLManagedTensor **out_grad,
                            const DLManagedTensor *outputs, const DLManagedTensor *labels,
                            int32_t microbatch, void *user_data) {
    (void)out_loss;
    (void)out_grad;
    (void)outputs;
    (void)labels;
    (void)microbatch;
    (void)user_data;
    return 7;
}

static void a_call_failing_before_any_final_gradient_leaves_no_trace(void **state) {
    (void)state;
    rp_model *m = make_model(RP_HOST_MEMORY_SAVING, RP_DTYPE_F32, 31);
    rp_loss *bad = NULL, *mse = NULL;
    TS_OK(rp_loss_create_callback(&bad, failing_loss, NULL));
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    rp_optimizer *opt = ts_adamw(1e-2);
    TS_OK(rp_model_set_step_in_call(m, opt));
    batch b;
    batch_init(&b, 2);
    ts_params *before = ts_masters(m);
    double l = 0.0;
    TS_ERR(train_call(&l, m, &b, bad, cfg), RP_ERR_CALLBACK, "7");
    TS_OK(rp_synchronize(m));
    ts_params *after = ts_masters(m), *grads = ts_grads(m);
    ts_assert_params_equal(after, before);
    ts_assert_all_zero(grads);
    /* Still usable, and still stepping inside its calls: like a fresh model's explicit step. */
    assert_next_call_steps_like_a_fresh_model(m, 31, &b, mse, cfg, opt);
    ts_params_free(before);
    ts_params_free(after);
    ts_params_free(grads);
    batch_free(&b);
    rp_optimizer_destroy(opt);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(bad);
    rp_loss_destroy(mse);
    rp_model_destroy(m);
}

/* ---- a call failing in a backward stage, after the deeper stages were updated ---------------- */

static rp_model *tripwire_model(int *fail_flag) {
    rp_model_options *o = ts_options(37, 3);
    TS_OK(rp_model_options_set_host_memory_mode(o, RP_HOST_MEMORY_SAVING));
    return ts_tripwire_model(fail_flag, o);
}

static void a_call_failing_in_a_backward_stage_keeps_the_final_updates_only(void **state) {
    (void)state;
    if (ts_device_kind() == RP_DEVICE_CUDA)
        skip(); /* the layer reads its tensors on the host */
    int fail_a = 1, fail_b = 0;
    rp_model *a = tripwire_model(&fail_a), *b = tripwire_model(&fail_b);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    rp_optimizer *opt = ts_adamw(1e-2);
    TS_OK(rp_model_set_step_in_call(a, opt));
    batch bt;
    batch_init(&bt, 4);
    ts_params *initial = ts_masters(a);
    double l = 0.0;
    TS_ERR(train_call(&l, a, &bt, loss, cfg), RP_ERR_CALLBACK, "tripwire");
    /* The reference for the parameters whose gradients were final: the whole call and an
     * explicit step on the twin model (the failing layer's backward does not touch them). */
    TS_OK(train_call(&l, b, &bt, loss, cfg));
    TS_OK(rp_step(b, opt, 0));
    TS_OK(rp_synchronize(a));
    ts_params *got = ts_masters(a), *stepped = ts_masters(b), *grads = ts_grads(a);
    size_t first_stage_params = 0;
    for (size_t p = 0; p < got->count; ++p) {
        /* Parameters are named "<layer>.<name>": layer 0 is the first stage's only parameters. */
        const int in_first_stage = got->names[p][0] == '0' && got->names[p][1] == '.';
        const ts_params *want = in_first_stage ? initial : stepped;
        first_stage_params += in_first_stage ? 1 : 0;
        for (int64_t i = 0; i < got->numel[p]; ++i) {
            if (got->data[p][i] != want->data[p][i]) {
                print_error("%s[%lld]: %.9g, want %.9g (%s)\n", got->names[p], (long long)i,
                            got->data[p][i], want->data[p][i],
                            in_first_stage ? "never final: unchanged" : "final: updated");
                fail();
            }
        }
    }
    assert_int_equal(first_stage_params, 2);
    ts_assert_all_zero(grads);
    /* Usable: with the tripwire off, the next call steps as before. */
    fail_a = 0;
    TS_OK(train_call(&l, a, &bt, loss, cfg));
    assert_true(isfinite(l));
    ts_params_free(initial);
    ts_params_free(got);
    ts_params_free(stepped);
    ts_params_free(grads);
    batch_free(&bt);
    rp_optimizer_destroy(opt);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* An embedding first layer in a bf16 model: the in-call step updates the rows a call used at
 * once and defers the others (docs/semantics.md "Deferred table rows"), serving the rows the next
 * call posts first. Against the same calls with explicit steps, bit for bit: the weights after
 * five calls (each on other random tokens of a 200,000-row table, so nearly every row is
 * deferred each time, in four pieces, long enough for the next call to post its rows
 * meanwhile), every call's loss, and an rp_forward between two calls that reads every row (a
 * reader that posted nothing must find the whole update). */
enum { VOCAB = 200000, TOKENS = 24, WIDTH = 64 };

static const char *TABLE_SPEC =
    "{\"layers\": [{\"type\": \"embedding\", \"num\": 200000, \"dim\": 64},"
    " {\"type\": \"linear\", \"in\": 64, \"out\": 32}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 32, \"out\": 3}]}";

static rp_model *make_table_model(void) {
    static const int32_t plan[3] = {1, 2, 1};
    return staged_model(TABLE_SPEC, RP_HOST_MEMORY_SAVING, RP_DTYPE_BF16, 41, 2, plan, 3);
}

static DLManagedTensor *token_ids(int k, int all_rows) {
    int64_t n = all_rows ? VOCAB : TOKENS;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)n);
    float *u = malloc(sizeof(float) * (size_t)n);
    assert_non_null(ids);
    assert_non_null(u);
    ts_fill_uniform(u, (int)n, 70 + k, 0.f, 1.f);
    for (int64_t i = 0; i < n; ++i)
        ids[i] = all_rows ? i : (int64_t)(u[i] * (VOCAB - 1));
    DLManagedTensor *t = ts_i64(1, &n, ids);
    free(ids);
    free(u);
    return t;
}

/* Copies of a forward's first output's bytes. */
static size_t forward_bytes(rp_model *m, const DLManagedTensor *ids, unsigned char *out,
                            size_t cap) {
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, m, &ids, 1, NULL));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    size_t n = 1;
    for (int32_t d = 0; d < o->dl_tensor.ndim; ++d)
        n *= (size_t)o->dl_tensor.shape[d];
    n *= (size_t)o->dl_tensor.dtype.bits / 8;
    assert_true(n <= cap);
    memcpy(out, (const unsigned char *)o->dl_tensor.data + o->dl_tensor.byte_offset, n);
    ts_free(o);
    rp_tensor_list_destroy(outs);
    return n;
}

static ts_params *train_table(int in_call, double *losses, unsigned char *seen, size_t *seen_n) {
    rp_model *m = make_table_model();
    training t = start_training(m, in_call, 3, RP_GRAIN_STAGE);
    for (int it = 0; it < 5; ++it) {
        DLManagedTensor *ids = token_ids(it, 0);
        float y[TOKENS * 3];
        int64_t ys[2] = {TOKENS, 3};
        ts_fill_uniform(y, TOKENS * 3, 90 + it, -1.f, 1.f);
        DLManagedTensor *lab = ts_f32(2, ys, y);
        const DLManagedTensor *inputs[1] = {ids};
        TS_OK(rp_forward_backward(&losses[it], NULL, m, inputs, 1, lab, t.loss, t.cfg));
        if (!in_call)
            TS_OK(rp_step(m, t.opt, 1));
        if (it == 2) {
            DLManagedTensor *all = token_ids(0, 1);
            *seen_n = forward_bytes(m, all, seen, VOCAB * 3 * 4);
            ts_free(all);
        }
        ts_free(ids);
        ts_free(lab);
    }
    return masters_after_training(m, t.opt, t.cfg, t.loss);
}

static void a_tables_deferred_rows_give_bitwise_the_weights_of_explicit_steps(void **state) {
    (void)state;
    double explicit_losses[5], in_call_losses[5];
    unsigned char *explicit_seen = malloc(VOCAB * 3 * 4), *in_call_seen = malloc(VOCAB * 3 * 4);
    assert_non_null(explicit_seen);
    assert_non_null(in_call_seen);
    size_t explicit_n = 0, in_call_n = 0;
    ts_params *want = train_table(0, explicit_losses, explicit_seen, &explicit_n);
    ts_params *got = train_table(1, in_call_losses, in_call_seen, &in_call_n);
    ts_assert_params_equal(got, want);
    for (int it = 0; it < 5; ++it)
        assert_true(in_call_losses[it] == explicit_losses[it]);
    assert_true(in_call_n == explicit_n && in_call_n > 0);
    assert_memory_equal(in_call_seen, explicit_seen, in_call_n);
    /* The steps moved the table's last row, which no token names (ids stop at VOCAB - 2): a
     * zero-gradient row, deferred by every in-call step, decays by lr * weight_decay = 1e-4 per
     * step (AdamW's default decay 1e-2), 5e-4 over the five. */
    rp_model *fresh = make_table_model();
    ts_params *initial = ts_masters(fresh);
    const float *last = got->data[0] + (VOCAB - 1) * WIDTH;
    assert_true(ts_rel_err(last, initial->data[0] + (VOCAB - 1) * WIDTH, WIDTH, 1e-30) > 3e-4);
    ts_params_free(initial);
    rp_model_destroy(fresh);
    ts_params_free(want);
    ts_params_free(got);
    free(explicit_seen);
    free(in_call_seen);
}

/* An embedding's rows leave the device after every microbatch (docs/semantics.md), but only the
 * last microbatch's make the table's gradient final: an in-call step that took the table after
 * the first microbatch's rows would miss the others. Token ids from a few rows of the table, so
 * every microbatch adds to the same rows; a wide middle stage on the other device, so the next
 * microbatch's rows come well after the previous ones (an early update would have run by then).
 * Against explicit steps (which read the gradient only after the call), bit for bit, over three
 * calls of three microbatches, fp32. */
enum { RT_VOCAB = 4096, RT_TOKENS = 1536, RT_USED = 48 };

static const char *ROW_TABLE_SPEC =
    "{\"layers\": [{\"type\": \"embedding\", \"num\": 4096, \"dim\": 64},"
    " {\"type\": \"linear\", \"in\": 64, \"out\": 512}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 512, \"out\": 512}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 512, \"out\": 3}]}";

static ts_params *train_row_table(int in_call) {
    static const int32_t plan[3] = {1, 4, 1};
    rp_model *m = staged_model(ROW_TABLE_SPEC, RP_HOST_MEMORY_SAVING, RP_DTYPE_F32, 43, 2, plan, 3);
    training t = start_training(m, in_call, 3, RP_GRAIN_STAGE);
    static int64_t ids[RT_TOKENS];
    static float u[RT_TOKENS], y[RT_TOKENS * 3];
    for (int it = 0; it < 3; ++it) {
        ts_fill_uniform(u, RT_TOKENS, 300 + it, 0.f, 1.f);
        for (int i = 0; i < RT_TOKENS; ++i)
            ids[i] = (int64_t)(u[i] * (RT_USED - 1));
        int64_t n = RT_TOKENS, ys[2] = {RT_TOKENS, 3};
        ts_fill_uniform(y, RT_TOKENS * 3, 310 + it, -1.f, 1.f);
        DLManagedTensor *in = ts_i64(1, &n, ids), *lab = ts_f32(2, ys, y);
        const DLManagedTensor *inputs[1] = {in};
        double l = 0.0;
        TS_OK(rp_forward_backward(&l, NULL, m, inputs, 1, lab, t.loss, t.cfg));
        if (!in_call)
            TS_OK(rp_step(m, t.opt, 1));
        ts_free(in);
        ts_free(lab);
    }
    return masters_after_training(m, t.opt, t.cfg, t.loss);
}

static void a_tables_rows_from_every_microbatch_reach_its_in_call_update(void **state) {
    (void)state;
    ts_params *want = train_row_table(0);
    ts_params *got = train_row_table(1);
    ts_assert_params_equal(got, want);
    ts_params_free(want);
    ts_params_free(got);
}

int main(void) {
    if (ts_gpu_missing())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(in_call_steps_give_bitwise_the_weights_of_explicit_steps),
        cmocka_unit_test(in_call_steps_follow_torch_adamw_within_bf16_moments),
        cmocka_unit_test(what_cannot_hold_is_refused_with_nothing_changed),
        cmocka_unit_test(a_nan_loss_leaves_the_weights_alone),
        cmocka_unit_test(a_call_failing_before_any_final_gradient_leaves_no_trace),
        cmocka_unit_test(a_call_failing_in_a_backward_stage_keeps_the_final_updates_only),
        cmocka_unit_test(a_tables_deferred_rows_give_bitwise_the_weights_of_explicit_steps),
        cmocka_unit_test(a_tables_rows_from_every_microbatch_reach_its_in_call_update),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
