/*
 * test_optimizer.c - the built-in CPU optimizers against the update formulas of
 * torch.optim.AdamW and torch.optim.SGD written out here in double precision.
 *
 * Parameters of many sizes go through the kernels: 1, 3, 7, 13, 17, 91, 221, 1000, 3000,
 * 17000 elements (odd sizes hit the tails of vectorised loops) and 1,000,000 (the
 * multi-threaded path). Gradients come from real forward_backward calls; before each step the
 * test reads them (rp_param_grad after rp_synchronize) and feeds the same values to its own
 * double-precision optimizer.
 *
 * Tolerances: weights are fp32 on the engine's side, so each step rounds them (relative 6e-8);
 * the check is ||w - w_ref|| <= 1e-6 ||w_ref|| per parameter. The update itself
 * (w_t - w_{t-1}) must match the reference update to 1e-4 relative, plus the two roundings of
 * the fp32 weights it is computed from (2 * 6e-8 ||w||).
 *
 * rp_adam_apply (the same kernel over caller-owned tensors, with Adam's L2 variant) is checked
 * against the same double-precision formulas, and against bad input that must change nothing.
 */
#include "test_support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 1, \"out\": 1},"
                          "{\"type\": \"linear\", \"in\": 1, \"out\": 7},"
                          "{\"type\": \"tanh\"},"
                          "{\"type\": \"linear\", \"in\": 7, \"out\": 13},"
                          "{\"type\": \"linear\", \"in\": 13, \"out\": 17},"
                          "{\"type\": \"silu\"},"
                          "{\"type\": \"linear\", \"in\": 17, \"out\": 1000},"
                          "{\"type\": \"rms_norm\", \"dim\": 1000},"
                          "{\"type\": \"linear\", \"in\": 1000, \"out\": 1000},"
                          "{\"type\": \"linear\", \"in\": 1000, \"out\": 3}]}";

typedef struct dref {
    size_t count;
    int64_t *numel;
    double **w, **m, **v; /* v unused by SGD; m is SGD's momentum buffer */
    int64_t step;
} dref;

static dref *dref_from(const ts_params *p) {
    dref *r = calloc(1, sizeof *r);
    r->count = p->count;
    r->numel = calloc(p->count, sizeof(int64_t));
    r->w = calloc(p->count, sizeof(double *));
    r->m = calloc(p->count, sizeof(double *));
    r->v = calloc(p->count, sizeof(double *));
    for (size_t i = 0; i < p->count; ++i) {
        r->numel[i] = p->numel[i];
        r->w[i] = malloc(sizeof(double) * p->numel[i]);
        r->m[i] = calloc(p->numel[i], sizeof(double));
        r->v[i] = calloc(p->numel[i], sizeof(double));
        for (int64_t j = 0; j < p->numel[i]; ++j)
            r->w[i][j] = p->data[i][j];
    }
    return r;
}

static void dref_free(dref *r) {
    for (size_t i = 0; i < r->count; ++i) {
        free(r->w[i]);
        free(r->m[i]);
        free(r->v[i]);
    }
    free(r->w);
    free(r->m);
    free(r->v);
    free(r->numel);
    free(r);
}

/* torch.optim.AdamW (amsgrad off): w *= 1 - lr wd; m = b1 m + (1-b1) g;
 * v = b2 v + (1-b2) g^2; w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). */
static void dref_adamw(dref *r, const ts_params *g, double lr, double b1, double b2, double eps,
                       double wd) {
    ++r->step;
    double bc1 = 1.0 - pow(b1, (double)r->step), bc2 = 1.0 - pow(b2, (double)r->step);
    for (size_t i = 0; i < r->count; ++i)
        for (int64_t j = 0; j < r->numel[i]; ++j) {
            double gr = g->data[i][j];
            double *w = &r->w[i][j], *m = &r->m[i][j], *v = &r->v[i][j];
            *w *= 1.0 - lr * wd;
            *m = b1 * *m + (1.0 - b1) * gr;
            *v = b2 * *v + (1.0 - b2) * gr * gr;
            *w -= lr / bc1 * *m / (sqrt(*v) / sqrt(bc2) + eps);
        }
}

/* torch.optim.SGD (dampening 0, no Nesterov): d = g + wd w; buf = d at the first step, else
 * momentum buf + d (only when momentum != 0); w -= lr buf. */
static void dref_sgd(dref *r, const ts_params *g, double lr, double momentum, double wd) {
    ++r->step;
    for (size_t i = 0; i < r->count; ++i)
        for (int64_t j = 0; j < r->numel[i]; ++j) {
            double *w = &r->w[i][j], *buf = &r->m[i][j];
            double d = g->data[i][j] + wd * *w;
            if (momentum != 0.0) {
                *buf = r->step == 1 ? d : momentum * *buf + d;
                d = *buf;
            }
            *w -= lr * d;
        }
}

static void compare(const ts_params *now, const ts_params *before, const dref *r,
                    const double *const *ref_before, int step) {
    int bad = 0;
    for (size_t i = 0; i < r->count; ++i) {
        double dw = 0, nw = 0, du = 0, nu = 0;
        for (int64_t j = 0; j < r->numel[i]; ++j) {
            double got = now->data[i][j], want = r->w[i][j];
            dw += (got - want) * (got - want);
            nw += want * want;
            double gu = got - before->data[i][j], wu = want - ref_before[i][j];
            du += (gu - wu) * (gu - wu);
            nu += wu * wu;
        }
        dw = sqrt(dw);
        nw = sqrt(nw);
        du = sqrt(du);
        nu = sqrt(nu);
        if (!(dw <= 1e-6 * fmax(nw, 1e-6))) {
            print_error("step %d, %s (%lld elements): weight error %.3g relative "
                        "(norms: got-ref %.3g, ref %.3g)\n",
                        step, now->names[i], (long long)r->numel[i], dw / fmax(nw, 1e-6), dw, nw);
            bad = 1;
        }
        if (!(du <= 1e-4 * nu + 1.2e-7 * nw + 1e-12)) {
            print_error("step %d, %s (%lld elements): update error %.3g relative\n", step,
                        now->names[i], (long long)r->numel[i], du / fmax(nu, 1e-30));
            bad = 1;
        }
    }
    if (bad)
        fail();
}

static void fb(rp_model *model, int it) {
    float x[4], y[12];
    ts_fill_uniform(x, 4, 70 + it, -1.f, 1.f);
    ts_fill_uniform(y, 12, 80 + it, -1.f, 1.f);
    int64_t xs[2] = {4, 1}, ys[2] = {4, 3};
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    const DLManagedTensor *inputs[1] = {in};
    TS_OK(rp_forward_backward(NULL, NULL, model, inputs, 1, lab, loss, NULL));
    rp_loss_destroy(loss);
    ts_free(in);
    ts_free(lab);
}

typedef enum { ADAMW, SGD } kind;

typedef struct hyper {
    double lr, b1, b2, eps, wd, momentum;
} hyper;

/* Run `steps` sync steps with hyperparameters hp[t] (the optimizer object is reused, so a
 * changed learning rate must take effect at the next step), comparing after each. */
static rp_model *model_of(int32_t dtype) {
    if (dtype == RP_DTYPE_F32)
        return ts_model(SPEC, 41, 2, NULL, 0);
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_seed(o, 41));
    TS_OK(rp_model_options_set_devices(o, ts_device_kind(), ts_devices(2)));
    TS_OK(rp_model_options_set_model_dtype(o, dtype));
    rp_model *model = NULL;
    TS_OK(rp_model_create(&model, SPEC, o));
    rp_model_options_destroy(o);
    return model;
}

/* `dtype`: the model dtype. The masters and the gradients the steps read are fp32 either way;
 * a bf16 model's standard-mode step also writes its bf16 weight copy in the same pass. */
static void run_dtype(kind k, const hyper *hp, int steps, rp_optimizer *opt, int set_values,
                      int32_t dtype) {
    rp_model *model = model_of(dtype);
    ts_params *w = ts_masters(model);
    dref *r = dref_from(w);
    double **ref_before = calloc(r->count, sizeof(double *));
    for (size_t i = 0; i < r->count; ++i)
        ref_before[i] = malloc(sizeof(double) * r->numel[i]);
    for (int t = 0; t < steps; ++t) {
        fb(model, t);
        ts_params *g = ts_grads(model);
        for (size_t i = 0; i < g->count; ++i) /* a diverging test would compare NaN to NaN */
            for (int64_t j = 0; j < g->numel[i]; ++j)
                assert_true(isfinite(g->data[i][j]));
        if (set_values) {
            TS_OK(rp_optimizer_set_learning_rate(opt, hp[t].lr));
            TS_OK(rp_optimizer_set_weight_decay(opt, hp[t].wd));
            if (k == ADAMW) {
                TS_OK(rp_optimizer_set_betas(opt, hp[t].b1, hp[t].b2));
                TS_OK(rp_optimizer_set_eps(opt, hp[t].eps));
            } else {
                TS_OK(rp_optimizer_set_momentum(opt, hp[t].momentum));
            }
        }
        TS_OK(rp_step(model, opt, 0));
        for (size_t i = 0; i < r->count; ++i)
            memcpy(ref_before[i], r->w[i], sizeof(double) * r->numel[i]);
        if (k == ADAMW)
            dref_adamw(r, g, hp[t].lr, hp[t].b1, hp[t].b2, hp[t].eps, hp[t].wd);
        else
            dref_sgd(r, g, hp[t].lr, hp[t].momentum, hp[t].wd);
        ts_params *now = ts_masters(model);
        compare(now, w, r, (const double *const *)ref_before, t + 1);
        ts_params_free(w);
        w = now;
        ts_params_free(g);
    }
    for (size_t i = 0; i < r->count; ++i)
        free(ref_before[i]);
    free(ref_before);
    ts_params_free(w);
    dref_free(r);
    rp_model_destroy(model);
}

static void run(kind k, const hyper *hp, int steps, rp_optimizer *opt, int set_values) {
    run_dtype(k, hp, steps, opt, set_values, RP_DTYPE_F32);
}

static void adamw_on_a_bf16_model_matches_torch_formula(void **state) {
    (void)state;
    hyper hp[3];
    for (int t = 0; t < 3; ++t)
        hp[t] = (hyper){1e-2, 0.8, 0.99, 1e-6, 0.05, 0};
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    run_dtype(ADAMW, hp, 3, opt, 1, RP_DTYPE_BF16);
    rp_optimizer_destroy(opt);
}

/* A bf16 model in the standard mode: the step writes the weight copy the next call reads in its
 * own pass over the master, and zeroes the gradients it consumed. Checked against the plain
 * tensor copy rp_synchronize makes (the weights in use after a synchronous step must compute
 * what the master rounded by that copy computes, bit for bit) and against the gradients the
 * next step but one reads back (the buffer two steps consume in turn must start at zero). */
static void bf16_standard_steps_publish_the_rounded_master_and_zero_the_gradients(void **state) {
    (void)state;
    rp_model *model = model_of(RP_DTYPE_BF16);
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 1e-2));
    float x[8];
    ts_fill_uniform(x, 8, 99, -1.f, 1.f);
    int64_t xs[2] = {8, 1};
    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    uint16_t after_step[24], after_refresh[24]; /* the bf16 outputs' bits */
    for (int t = 0; t < 2; ++t) {
        fb(model, t);
        TS_OK(rp_step(model, opt, 0)); /* synchronous: the step's weights are the ones in use */
    }
    rp_tensor_list *out = NULL;
    DLManagedTensor *o = NULL;
    TS_OK(rp_forward(&out, model, inputs, 1, NULL));
    TS_OK(rp_tensor_list_get(&o, out, 0));
    assert_int_equal(ts_numel(&o->dl_tensor), 24);
    assert_int_equal(o->dl_tensor.dtype.bits, 16);
    memcpy(after_step, (const char *)o->dl_tensor.data + o->dl_tensor.byte_offset,
           sizeof after_step);
    ts_free(o);
    rp_tensor_list_destroy(out);
    /* The gradient buffer the first step consumed is the one accumulating now: zero. */
    TS_OK(rp_synchronize(model)); /* also copies every master into the weights in use */
    ts_params *g = ts_grads(model);
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t j = 0; j < g->numel[i]; ++j)
            assert_true(g->data[i][j] == 0.0f);
    ts_params_free(g);
    TS_OK(rp_forward(&out, model, inputs, 1, NULL));
    TS_OK(rp_tensor_list_get(&o, out, 0));
    memcpy(after_refresh, (const char *)o->dl_tensor.data + o->dl_tensor.byte_offset,
           sizeof after_refresh);
    ts_free(o);
    rp_tensor_list_destroy(out);
    assert_memory_equal(after_step, after_refresh, sizeof after_step);
    ts_free(in);
    rp_optimizer_destroy(opt);
    rp_model_destroy(model);
}

static void adamw_matches_torch_formula_for_all_param_sizes(void **state) {
    (void)state;
    hyper hp[4];
    for (int t = 0; t < 4; ++t)
        hp[t] = (hyper){1e-2, 0.8, 0.99, 1e-6, 0.05, 0};
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    run(ADAMW, hp, 4, opt, 1);
    rp_optimizer_destroy(opt);
}

static void adamw_defaults_are_pytorch_defaults(void **state) {
    (void)state;
    hyper hp[3];
    for (int t = 0; t < 3; ++t)
        hp[t] = (hyper){1e-3, 0.9, 0.999, 1e-8, 1e-2, 0};
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    run(ADAMW, hp, 3, opt, 0);
    rp_optimizer_destroy(opt);
}

static void adamw_learning_rate_and_betas_changes_take_effect_at_next_step(void **state) {
    (void)state;
    hyper hp[4] = {{1e-2, 0.9, 0.999, 1e-8, 0.0, 0},
                   {3e-3, 0.9, 0.999, 1e-8, 0.1, 0},
                   {2e-2, 0.5, 0.9, 1e-4, 0.0, 0},
                   {0.0, 0.9, 0.999, 1e-8, 0.0, 0}};
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    run(ADAMW, hp, 4, opt, 1);
    rp_optimizer_destroy(opt);
}

static void sgd_momentum_and_weight_decay_match_torch_formula(void **state) {
    (void)state;
    hyper hp[4];
    for (int t = 0; t < 4; ++t)
        hp[t] = (hyper){5e-3, 0, 0, 0, 0.01, 0.9};
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    run(SGD, hp, 4, opt, 1);
    rp_optimizer_destroy(opt);
}

static void sgd_defaults_are_plain_sgd_with_lr_1e_3(void **state) {
    (void)state;
    hyper hp[3];
    for (int t = 0; t < 3; ++t)
        hp[t] = (hyper){1e-3, 0, 0, 0, 0.0, 0.0};
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    run(SGD, hp, 3, opt, 0);
    rp_optimizer_destroy(opt);
}

/* Switching optimizer kinds on a model that holds AdamW state is refused, and changes nothing. */
static void switching_optimizer_kind_is_a_state_error(void **state) {
    (void)state;
    rp_model *model = ts_model(SPEC, 42, 1, NULL, 0);
    rp_optimizer *adam = NULL, *sgd = NULL;
    TS_OK(rp_optimizer_create(&adam, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_create(&sgd, RP_OPTIMIZER_SGD));
    fb(model, 0);
    TS_OK(rp_step(model, adam, 0));
    fb(model, 1);
    ts_params *w = ts_masters(model), *g = ts_grads(model);
    TS_ERR(rp_step(model, sgd, 0), RP_ERR_STATE, "adamw|sgd|optimizer");
    ts_params *w2 = ts_masters(model), *g2 = ts_grads(model);
    ts_assert_params_equal(w2, w);
    ts_assert_params_equal(g2, g); /* the gradients stay for a step of the right kind */
    int64_t steps = 0;
    TS_OK(rp_model_step_count(&steps, model));
    assert_int_equal(steps, 1);
    TS_OK(rp_step(model, adam, 0));
    TS_OK(rp_model_step_count(&steps, model));
    assert_int_equal(steps, 2);
    ts_params_free(w);
    ts_params_free(w2);
    ts_params_free(g);
    ts_params_free(g2);
    rp_optimizer_destroy(adam);
    rp_optimizer_destroy(sgd);
    rp_model_destroy(model);
}

/* ---- rp_adam_apply: the kernel over caller-owned tensors ----------------------------------- */

#define AA_N 3
static const int64_t AA_SIZES[AA_N] = {1, 37, 70001}; /* scalar, a vector tail, threaded */

typedef struct aa_set {
    DLManagedTensor *p[AA_N], *g[AA_N], *m[AA_N], *v[AA_N];
    double *w[AA_N], *dm[AA_N], *dv[AA_N]; /* the double-precision reference */
} aa_set;

static float *aa_data(DLManagedTensor *t) { return (float *)t->dl_tensor.data; }

static void aa_init(aa_set *s) {
    for (int i = 0; i < AA_N; ++i) {
        int64_t n = AA_SIZES[i];
        float *w = malloc(sizeof(float) * n);
        ts_fill_uniform(w, n, 500 + i, -1.f, 1.f);
        s->p[i] = ts_f32(1, &AA_SIZES[i], w);
        s->g[i] = ts_f32(1, &AA_SIZES[i], NULL);
        s->m[i] = ts_f32(1, &AA_SIZES[i], NULL);
        s->v[i] = ts_f32(1, &AA_SIZES[i], NULL);
        s->w[i] = malloc(sizeof(double) * n);
        s->dm[i] = calloc(n, sizeof(double));
        s->dv[i] = calloc(n, sizeof(double));
        for (int64_t j = 0; j < n; ++j)
            s->w[i][j] = w[j];
        free(w);
    }
}

static void aa_free(aa_set *s) {
    for (int i = 0; i < AA_N; ++i) {
        ts_free(s->p[i]);
        ts_free(s->g[i]);
        ts_free(s->m[i]);
        ts_free(s->v[i]);
        free(s->w[i]);
        free(s->dm[i]);
        free(s->dv[i]);
    }
}

/* torch.optim.Adam, one parameter, in double: AdamW scales the weight by 1 - lr wd first;
 * Adam (L2) adds wd w to the gradient the moments see. */
static void aa_reference(double *w, double *m, double *v, const float *g, int64_t n, int64_t t,
                         double lr, double b1, double b2, double eps, double wd, int decoupled) {
    double bc1 = 1.0 - pow(b1, (double)t), bc2 = 1.0 - pow(b2, (double)t);
    for (int64_t j = 0; j < n; ++j) {
        double gr = g[j];
        if (decoupled)
            w[j] *= 1.0 - lr * wd;
        else
            gr += wd * w[j];
        m[j] = b1 * m[j] + (1.0 - b1) * gr;
        v[j] = b2 * v[j] + (1.0 - b2) * gr * gr;
        w[j] -= lr / bc1 * m[j] / (sqrt(v[j]) / sqrt(bc2) + eps);
    }
}

/* Three steps with fresh gradients, each parameter at its own step count (entry 0 joins one
 * step late, as a parameter whose .grad was None). Weights are fp32: each update rounds them
 * (relative 6e-8), and the moments are fp32 too, so the weight after three steps is checked to
 * 1e-6 relative (norm) against the double reference, as the built-in AdamW test does. */
static void adam_apply_matches_torch_formula(int decoupled) {
    aa_set s;
    aa_init(&s);
    const double lr = 1e-2, b1 = 0.8, b2 = 0.95, eps = 1e-6, wd = 0.1;
    int64_t steps[AA_N] = {0, 0, 0};
    for (int it = 0; it < 3; ++it) {
        for (int i = 0; i < AA_N; ++i)
            ts_fill_uniform(aa_data(s.g[i]), AA_SIZES[i], 900 + 10 * it + i, -2.f, 2.f);
        size_t first = it == 0 ? 1 : 0; /* entry 0 has no gradient at the first step */
        for (size_t i = first; i < AA_N; ++i) {
            ++steps[i];
            aa_reference(s.w[i], s.dm[i], s.dv[i], aa_data(s.g[i]), AA_SIZES[i], steps[i], lr,
                         b1, b2, eps, wd, decoupled);
        }
        TS_OK(rp_adam_apply(s.p + first, (const DLManagedTensor *const *)s.g + first,
                            s.m + first, s.v + first, steps + first, AA_N - first, lr, b1, b2,
                            eps, wd, decoupled));
    }
    for (int i = 0; i < AA_N; ++i) {
        double d = 0, nrm = 0;
        const float *got = aa_data(s.p[i]);
        for (int64_t j = 0; j < AA_SIZES[i]; ++j) {
            d += (got[j] - s.w[i][j]) * (got[j] - s.w[i][j]);
            nrm += s.w[i][j] * s.w[i][j];
        }
        if (!(sqrt(d) <= 1e-6 * fmax(sqrt(nrm), 1e-6)))
            fail_msg("entry %d (%lld elements, decoupled %d): weight error %.3g relative", i,
                     (long long)AA_SIZES[i], decoupled, sqrt(d) / fmax(sqrt(nrm), 1e-6));
    }
    aa_free(&s);
}

static void adam_apply_adamw_matches_torch_adamw_formula(void **state) {
    (void)state;
    adam_apply_matches_torch_formula(1);
}

static void adam_apply_l2_matches_torch_adam_formula(void **state) {
    (void)state;
    adam_apply_matches_torch_formula(0);
}

/* Snapshot of every tensor of a set, to prove a refused call wrote nothing. */
static float *aa_snapshot(const aa_set *s) {
    int64_t total = 0;
    for (int i = 0; i < AA_N; ++i)
        total += 4 * AA_SIZES[i];
    float *out = malloc(sizeof(float) * total), *o = out;
    for (int i = 0; i < AA_N; ++i) {
        DLManagedTensor *const parts[4] = {s->p[i], s->g[i], s->m[i], s->v[i]};
        for (int k = 0; k < 4; ++k) {
            memcpy(o, aa_data(parts[k]), sizeof(float) * AA_SIZES[i]);
            o += AA_SIZES[i];
        }
    }
    return out;
}

static void aa_assert_unchanged(const aa_set *s, const float *before, const char *what) {
    float *now = aa_snapshot(s);
    int64_t total = 0;
    for (int i = 0; i < AA_N; ++i)
        total += 4 * AA_SIZES[i];
    if (memcmp(now, before, sizeof(float) * total) != 0)
        fail_msg("a refused rp_adam_apply (%s) changed a tensor", what);
    free(now);
}

#define AA_CALL(set, steps)                                                                         \
    rp_adam_apply((set).p, (const DLManagedTensor *const *)(set).g, (set).m, (set).v, (steps),     \
                  AA_N, 1e-2, 0.9, 0.999, 1e-8, 0.0, 1)

static void adam_apply_refuses_bad_input_before_writing_anything(void **state) {
    (void)state;
    aa_set s;
    aa_init(&s);
    for (int i = 0; i < AA_N; ++i)
        ts_fill_uniform(aa_data(s.g[i]), AA_SIZES[i], 40 + i, -1.f, 1.f);
    int64_t steps[AA_N] = {1, 1, 1};
    float *before = aa_snapshot(&s);
    const DLManagedTensor *const *g = (const DLManagedTensor *const *)s.g;

    /* hyperparameters */
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, -1.0, 0.9, 0.999, 1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "lr");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, NAN, 0.9, 0.999, 1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "lr");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, 1e-3, 1.0, 0.999, 1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "beta1");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, 1e-3, 0.9, -0.1, 1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "beta2");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, 1e-3, 0.9, 0.999, -1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "eps");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, 1e-3, 0.9, 0.999, 1e-8, INFINITY, 1),
           RP_ERR_INVALID_ARGUMENT, "weight_decay");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, steps, AA_N, 1e-3, 0.9, 0.999, 1e-8, 0, 2),
           RP_ERR_INVALID_ARGUMENT, "decoupled_weight_decay");
    TS_ERR(rp_adam_apply(NULL, g, s.m, s.v, steps, AA_N, 1e-3, 0.9, 0.999, 1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "NULL");
    TS_ERR(rp_adam_apply(s.p, g, s.m, s.v, NULL, AA_N, 1e-3, 0.9, 0.999, 1e-8, 0, 1),
           RP_ERR_INVALID_ARGUMENT, "NULL");

    /* step counts: the last entry is bad, the first two must stay untouched */
    int64_t zero_step[AA_N] = {1, 1, 0};
    TS_ERR(AA_CALL(s, zero_step), RP_ERR_INVALID_ARGUMENT, "step 2");

    /* a bad tensor in the last entry, swapped in and out */
    const int64_t n2 = AA_SIZES[2], short_n = AA_SIZES[2] - 1, two_d[2] = {7, 10001};
    const int64_t strides[1] = {2};
    DLManagedTensor *wrong_dtype = ts_raw(TS_F64, TS_CPU, 1, &n2, NULL, sizeof(double) * n2);
    DLManagedTensor *wrong_shape = ts_f32(1, &short_n, NULL);
    DLManagedTensor *wrong_rank = ts_f32(2, two_d, NULL); /* same numel, other shape */
    DLManagedTensor *strided = ts_raw(TS_F32, TS_CPU, 1, &n2, strides, sizeof(float) * 2 * n2);
    DLManagedTensor *on_gpu = ts_raw(TS_F32, TS_CUDA0, 1, &n2, NULL, sizeof(float) * n2);
    struct {
        DLManagedTensor **slot;
        DLManagedTensor *bad;
        const char *needle;
    } cases[] = {
        {&s.p[2], wrong_dtype, "param 2"},      {&s.g[2], wrong_dtype, "grad 2"},
        {&s.m[2], wrong_shape, "exp_avg 2"},    {&s.v[2], wrong_rank, "exp_avg_sq 2"},
        {&s.g[2], strided, "contiguous"},       {&s.p[2], on_gpu, "param 2"},
        {&s.m[2], NULL, "exp_avg 2"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        DLManagedTensor *keep = *cases[c].slot;
        *cases[c].slot = cases[c].bad;
        TS_ERR(AA_CALL(s, steps), RP_ERR_INVALID_ARGUMENT, cases[c].needle);
        *cases[c].slot = keep;
    }

    /* aliasing: an updated tensor shared by two roles, or a gradient inside a weight */
    DLManagedTensor *keep = s.m[1];
    s.m[1] = s.p[1];
    TS_ERR(AA_CALL(s, steps), RP_ERR_INVALID_ARGUMENT, "overlaps");
    s.m[1] = keep;
    keep = s.v[2];
    s.v[2] = s.v[0]; /* shapes differ: caught as a shape error first */
    TS_ERR(AA_CALL(s, steps), RP_ERR_INVALID_ARGUMENT, "exp_avg_sq 2");
    s.v[2] = keep;
    DLManagedTensor view = *s.p[2]; /* a view of param 2's first 37 elements, as grad 1 */
    view.dl_tensor.shape = (int64_t *)&AA_SIZES[1];
    view.deleter = NULL;
    keep = s.g[1];
    s.g[1] = &view;
    TS_ERR(AA_CALL(s, steps), RP_ERR_INVALID_ARGUMENT, "grad 1", "overlaps");
    s.g[1] = keep;

    aa_assert_unchanged(&s, before, "bad input");
    free(before);
    ts_free(wrong_dtype);
    ts_free(wrong_shape);
    ts_free(wrong_rank);
    ts_free(strided);
    ts_free(on_gpu);
    aa_free(&s);
}

/* Gradients are only read: two entries may share one; n_tensors 0 is a no-op. */
static void adam_apply_allows_shared_gradients_and_empty_calls(void **state) {
    (void)state;
    TS_OK(rp_adam_apply(NULL, NULL, NULL, NULL, NULL, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 0));
    const int64_t n = 5;
    const float w0[5] = {0.5f, -1.f, 2.f, 0.f, 3.f}, grad[5] = {1.f, -2.f, 0.5f, 0.f, -4.f};
    DLManagedTensor *p[2] = {ts_f32(1, &n, w0), ts_f32(1, &n, w0)};
    DLManagedTensor *g = ts_f32(1, &n, grad);
    DLManagedTensor *m[2] = {ts_f32(1, &n, NULL), ts_f32(1, &n, NULL)};
    DLManagedTensor *v[2] = {ts_f32(1, &n, NULL), ts_f32(1, &n, NULL)};
    const DLManagedTensor *gs[2] = {g, g};
    const int64_t steps[2] = {1, 1};
    TS_OK(rp_adam_apply(p, gs, m, v, steps, 2, 0.1, 0.9, 0.999, 1e-8, 0, 0));
    /* First step, no decay: w - lr * g / (|g| + eps') = w - 0.1 * sign(g) (g != 0). */
    for (int k = 0; k < 2; ++k)
        for (int j = 0; j < 5; ++j) {
            float want = w0[j] - (grad[j] > 0 ? 0.1f : grad[j] < 0 ? -0.1f : 0.f);
            assert_float_equal(aa_data(p[k])[j], want, 1e-6);
        }
    for (int j = 0; j < 5; ++j)
        assert_true(aa_data(g)[j] == grad[j]); /* the gradient is not modified */
    for (int k = 0; k < 2; ++k) {
        ts_free(p[k]);
        ts_free(m[k]);
        ts_free(v[k]);
    }
    ts_free(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(adamw_matches_torch_formula_for_all_param_sizes),
        cmocka_unit_test(adamw_on_a_bf16_model_matches_torch_formula),
        cmocka_unit_test(bf16_standard_steps_publish_the_rounded_master_and_zero_the_gradients),
        cmocka_unit_test(adamw_defaults_are_pytorch_defaults),
        cmocka_unit_test(adamw_learning_rate_and_betas_changes_take_effect_at_next_step),
        cmocka_unit_test(sgd_momentum_and_weight_decay_match_torch_formula),
        cmocka_unit_test(sgd_defaults_are_plain_sgd_with_lr_1e_3),
        cmocka_unit_test(switching_optimizer_kind_is_a_state_error),
        cmocka_unit_test(adam_apply_adamw_matches_torch_adamw_formula),
        cmocka_unit_test(adam_apply_l2_matches_torch_adam_formula),
        cmocka_unit_test(adam_apply_refuses_bad_input_before_writing_anything),
        cmocka_unit_test(adam_apply_allows_shared_gradients_and_empty_calls),
    };
    return cmocka_run_group_tests_name("optimizer", tests, NULL, NULL);
}
