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
static void run(kind k, const hyper *hp, int steps, rp_optimizer *opt, int set_values) {
    rp_model *model = ts_model(SPEC, 41, 2, NULL, 0);
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(adamw_matches_torch_formula_for_all_param_sizes),
        cmocka_unit_test(adamw_defaults_are_pytorch_defaults),
        cmocka_unit_test(adamw_learning_rate_and_betas_changes_take_effect_at_next_step),
        cmocka_unit_test(sgd_momentum_and_weight_decay_match_torch_formula),
        cmocka_unit_test(sgd_defaults_are_plain_sgd_with_lr_1e_3),
        cmocka_unit_test(switching_optimizer_kind_is_a_state_error),
    };
    return cmocka_run_group_tests_name("optimizer", tests, NULL, NULL);
}
