/*
 * test_lent_gradients.c - the standard mode's lent gradients (ParamStore::lend_grad): a bf16
 * model's gradient, whole from one job, stays where its download landed and the built-in AdamW
 * reads it there, instead of the gradient thread widening it into the fp32 buffer and the step
 * reading and zeroing that.
 *
 * The reference is the same model on the buffer path: reading a gradient through rp_param_grad
 * widens it into the fp32 buffer first (the API hands out fp32), so a twin model whose gradients
 * are read before each step takes that path, which test_optimizer.c checks against the
 * double-precision AdamW formula. Widening bf16 to fp32 is exact, so the two must agree bit for
 * bit:
 *  - synchronous and asynchronous steps (the step reading lent gradients while the next call
 *    lends its own), with a second call before one step (its contributions land on lent
 *    gradients, which are widened before they add);
 *  - rp_zero_grad drops lent gradients: the API then reads zeros, and the next call's
 *    gradients alone are stepped;
 *  - a call failing after the deeper stages' gradients were lent leaves no trace: zero
 *    gradients, and the next call steps as on a fresh model (CPU devices: the failing layer
 *    reads its tensors on the host);
 *  - a tied embedding: its LM-head part lent, the embedding's rows added beside it in fp32
 *    (ParamStore::mark_rows_added), against a twin that never lends (a loss scale of 2): bit
 *    for bit when every token is used once (sync and async steps, gradients read through the
 *    API), to fp32 rounding when tokens repeat (the sum's order differs); bit for bit again
 *    when the embedding's gradient is dense (the two whole parts summed in one pass).
 */
#include "test_support.h"

#include <stdio.h>

enum { ROWS = 12, IN = 6, OUT = 3 }; /* IN and OUT: TS_MLP_SPEC's widths */

/* The model's seed and dtype, with or without the tripwire. */
static rp_model_options *bf16_options(void) {
    rp_model_options *o = ts_options(23, 3);
    TS_OK(rp_model_options_set_model_dtype(o, RP_DTYPE_BF16));
    return o;
}

/* Four stages (jobs) per call, so the gradients land in parts: ts_tripwire_model's stages
 * without the tripwire. */
static rp_model *bf16_model(void) {
    rp_model_options *o = bf16_options();
    const int32_t plan[4] = {2, 2, 2, 1};
    TS_OK(rp_model_options_set_stage_plan(o, plan, 4));
    return ts_model_with_options(TS_MLP_SPEC, o);
}

static rp_status train_call(rp_model *m, int k) {
    float x[ROWS * IN], y[ROWS * OUT];
    int64_t xs[2] = {ROWS, IN}, ys[2] = {ROWS, OUT};
    ts_fill_uniform(x, ROWS * IN, 300 + k, -1.f, 1.f);
    ts_fill_uniform(y, ROWS * OUT, 700 + k, -1.f, 1.f);
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    const DLManagedTensor *inputs[1] = {in};
    rp_status s = rp_forward_backward(NULL, NULL, m, inputs, 1, lab, loss, cfg);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ts_free(in);
    ts_free(lab);
    return s;
}

static rp_optimizer *adamw(void) {
    rp_optimizer *opt = ts_adamw(1e-2);
    TS_OK(rp_optimizer_set_weight_decay(opt, 0.1));
    return opt;
}

/* Reads every gradient through the API, which widens a lent one into its buffer. */
static void widen_gradients(rp_model *m) {
    size_t count = 0;
    TS_OK(rp_param_count(&count, m));
    for (size_t i = 0; i < count; ++i) {
        DLManagedTensor *g = NULL;
        TS_OK(rp_param_grad(&g, m, i));
        ts_free(g);
    }
}

/* Four steps; before the third, a second call accumulates onto the first. `widen`: read the
 * gradients before each step (the buffer path). */
static ts_params *train(int widen, int async) {
    rp_model *m = bf16_model();
    rp_optimizer *opt = adamw();
    for (int t = 0; t < 4; ++t) {
        TS_OK(train_call(m, t));
        if (t == 2)
            TS_OK(train_call(m, 10 + t));
        if (widen)
            widen_gradients(m);
        TS_OK(rp_step(m, opt, async));
    }
    ts_params *w = ts_masters(m);
    rp_optimizer_destroy(opt);
    rp_model_destroy(m);
    return w;
}

static void steps_read_lent_gradients_as_the_buffer_path_does(void **state) {
    (void)state;
    rp_model *fresh = bf16_model();
    ts_params *initial = ts_masters(fresh);
    rp_model_destroy(fresh);
    for (int async = 0; async < 2; ++async) {
        ts_params *lent = train(0, async), *widened = train(1, async);
        ts_assert_params_equal(lent, widened);
        /* The steps did something to every parameter. */
        for (size_t p = 0; p < lent->count; ++p)
            assert_true(ts_rel_err(lent->data[p], initial->data[p], lent->numel[p], 1e-30) >
                        1e-3);
        ts_params_free(lent);
        ts_params_free(widened);
    }
    ts_params_free(initial);
}

static void assert_gradients_zero(rp_model *m) {
    ts_params *g = ts_grads(m);
    ts_assert_all_zero(g);
    ts_params_free(g);
}

/* Both models train on batch k and step (synchronously): they must end bit for bit equal. */
static void step_both_and_compare(rp_model *a, rp_model *b, int k) {
    rp_optimizer *opt = adamw();
    TS_OK(train_call(a, k));
    TS_OK(rp_step(a, opt, 0));
    TS_OK(train_call(b, k));
    TS_OK(rp_step(b, opt, 0));
    ts_params *wa = ts_masters(a), *wb = ts_masters(b);
    ts_assert_params_equal(wa, wb);
    ts_params_free(wa);
    ts_params_free(wb);
    rp_optimizer_destroy(opt);
}

static void zero_grad_drops_lent_gradients(void **state) {
    (void)state;
    rp_model *a = bf16_model(), *b = bf16_model();
    TS_OK(train_call(a, 1));
    TS_OK(rp_zero_grad(a));
    assert_gradients_zero(a); /* a lent gradient kept would be widened here */
    step_both_and_compare(a, b, 2);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* ---- a call failing after the deeper stages' gradients were lent ------------------------------ */

/* The tripwire (test_support.h) in the first stage fails the call's last backward microbatch,
 * after every deeper stage has delivered (lent) its gradients. */
static rp_model *tripwire_model(int *fail_flag) {
    return ts_tripwire_model(fail_flag, bf16_options());
}

static void a_failed_call_gives_back_what_it_lent(void **state) {
    (void)state;
    if (ts_device_kind() == RP_DEVICE_CUDA)
        skip(); /* the layer reads its tensors on the host */
    int fail_a = 1, fail_b = 0;
    rp_model *a = tripwire_model(&fail_a), *b = tripwire_model(&fail_b);
    TS_ERR(train_call(a, 4), RP_ERR_CALLBACK, "tripwire");
    assert_gradients_zero(a);
    fail_a = 0;
    step_both_and_compare(a, b, 5);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

/* ---- a tied embedding: the LM-head part lent, the embedding's rows added beside it ---------- */

enum { TB = 4, TT = 8, TV = 96 };

/* The tokens of a call: every id once (a permutation of part of the vocabulary), a few ids
 * repeated throughout, or four times as many tokens, so that the embedding's gradient is dense
 * (more tokens than the vocabulary has rows: embedding_row_gradient). */
typedef enum { IDS_DISTINCT, IDS_REPEATED, IDS_DENSE } tied_ids;

/* Qwen3-style, embedding and LM head tied, two stages: the embedding and a layer first, the
 * LM head in the tail, so the LM-head part of the tied gradient lands first and the embedding's
 * rows (a row gradient: 32 tokens of a 96-word vocabulary) with the call's last job. */
static const char *TIED =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 96, \"hidden_size\": 64,"
    " \"intermediate_size\": 80, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 16, \"rms_norm_eps\": 1e-5, \"rope_theta\": "
    "10000, \"tie_word_embeddings\": true, \"initializer_range\": 0.1}";

/* `loss_scale` 2 (the twin): every contribution comes scaled and is multiplied by 1/2 on the
 * host, which is never lent, so the LM-head part is widened into the fp32 buffer when it lands
 * and the rows add into it; a power of two scales every rounding of the backward exactly, so the
 * contributions are the same numbers. */
static rp_model *tied_model(double loss_scale) {
    rp_model_options *o = ts_options(31, 2);
    TS_OK(rp_model_options_set_model_dtype(o, RP_DTYPE_BF16));
    TS_OK(rp_model_options_set_grad_scaler(o, loss_scale, 1000000));
    const int32_t plan[2] = {2, 3};
    TS_OK(rp_model_options_set_stage_plan(o, plan, 2));
    return ts_hf_model_with_options(TIED, o);
}

static void tied_call(rp_model *m, int k, tied_ids kind) {
    const int64_t t = kind == IDS_DENSE ? 4 * TT : TT;
    int64_t ids[TB * 4 * TT], shape[2] = {TB, t};
    for (int i = 0; i < TB * t; ++i)
        ids[i] = kind == IDS_REPEATED ? (i * 5 + k) % 7 : (i * 37 + k * 11) % TV;
    DLManagedTensor *in = ts_i64(2, shape, ids), *lab = ts_i64(2, shape, ids);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_CAUSAL_LM));
    rp_run_config *cfg = ts_config(2, 0);
    const DLManagedTensor *inputs[1] = {in};
    TS_OK(rp_forward_backward(NULL, NULL, m, inputs, 1, lab, loss, cfg));
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ts_free(in);
    ts_free(lab);
}

/* Three steps of each model; `read_grads`: the lent model's gradients are read (widened through
 * the API) after each call and compared with the twin's first. */
static void train_tied(rp_model *lent, rp_model *twin, tied_ids kind, int async,
                       int read_grads) {
    rp_optimizer *opt = adamw();
    for (int t = 0; t < 3; ++t) {
        tied_call(lent, t, kind);
        tied_call(twin, t, kind);
        if (read_grads) {
            ts_params *gl = ts_grads(lent), *gt = ts_grads(twin);
            ts_assert_params_equal(gl, gt);
            ts_params_free(gl);
            ts_params_free(gt);
        }
        TS_OK(rp_step(lent, opt, async));
        TS_OK(rp_step(twin, opt, async));
    }
    TS_OK(rp_synchronize(lent));
    TS_OK(rp_synchronize(twin));
    rp_optimizer_destroy(opt);
}

static void tied_rows_add_beside_the_lent_lm_head_part(void **state) {
    (void)state;
    rp_model *fresh = tied_model(0);
    ts_params *initial = ts_masters(fresh);
    rp_model_destroy(fresh);
    /* sync, async, gradients read; then a dense embedding gradient: the two whole parts summed
     * in one pass (ParamStore::materialize_grad_adding) */
    for (int variant = 0; variant < 4; ++variant) {
        rp_model *lent = tied_model(0), *twin = tied_model(2);
        train_tied(lent, twin, variant == 3 ? IDS_DENSE : IDS_DISTINCT, variant == 1,
                   variant == 2);
        ts_params *wl = ts_masters(lent), *wt = ts_masters(twin);
        ts_assert_params_equal(wl, wt);
        for (size_t p = 0; p < wl->count; ++p) /* every parameter moved, the tied one too */
            assert_true(ts_rel_err(wl->data[p], initial->data[p], wl->numel[p], 1e-30) > 1e-3);
        ts_params_free(wl);
        ts_params_free(wt);
        rp_model_destroy(lent);
        rp_model_destroy(twin);
    }
    ts_params_free(initial);
}

/* Repeated ids: the lent model sums a row's uses first and then adds the LM-head part, the twin
 * adds each use to the LM-head part in turn; fp32 sums of the same terms in another order, so
 * the weights after three steps agree to fp32 rounding (1e-5 relative: AdamW's first steps are
 * close to sign(g) * lr, which an ulp of gradient moves only for gradients near zero). */
static void tied_rows_repeated_agree_to_fp32_rounding(void **state) {
    (void)state;
    rp_model *lent = tied_model(0), *twin = tied_model(2);
    train_tied(lent, twin, IDS_REPEATED, 0, 0);
    ts_params *wl = ts_masters(lent), *wt = ts_masters(twin);
    ts_assert_params_close(wl, wt, 1e-5, "weights");
    ts_params_free(wl);
    ts_params_free(wt);
    rp_model_destroy(lent);
    rp_model_destroy(twin);
}

int main(void) {
    if (ts_gpu_missing())
        return 77;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(steps_read_lent_gradients_as_the_buffer_path_does),
        cmocka_unit_test(zero_grad_drops_lent_gradients),
        cmocka_unit_test(a_failed_call_gives_back_what_it_lent),
        cmocka_unit_test(tied_rows_add_beside_the_lent_lm_head_part),
        cmocka_unit_test(tied_rows_repeated_agree_to_fp32_rounding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
