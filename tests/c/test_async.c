/*
 * test_async.c - the staleness contract of rp_step, checked against arithmetic done by hand.
 *
 * Model: one `linear` 1 -> 1 without bias, so the model is y = w x. Data: x = (1, 2, -1, 0.5),
 * y = (2, 3, -1, 1), MSE. For a microbatch S, loss_S(w) = mean_S (w x - y)^2 and
 * dloss_S/dw = mean_S 2 x (w x - y); a call returns the sum over microbatches. The expected
 * weight sequences are computed here in double from the SGD formula of torch.optim.SGD:
 *   sync:  g_t = grad(w_{t-1}),                 w_t = w_{t-1} - lr g_t
 *   async: g_t = grad(w_{max(t-2, 0)}) (the forward_backward after step t-1 still runs on the
 *          weights of step t-2: staleness one),  w_t = w_{t-1} - lr g_t
 * Tolerance 1e-5 relative: the engine computes in fp32 (roundoff 6e-8 per operation, a handful
 * of operations per step); a stale-by-one mistake moves values by lr * g ~ 1e-1.
 */
#include "test_support.h"

#include <math.h>
#include <stdio.h>

static const char *SPEC = "{\"layers\": [{\"type\": \"linear\", \"in\": 1, \"out\": 1, "
                          "\"bias\": false}]}";
static const float X[4] = {1.0f, 2.0f, -1.0f, 0.5f};
static const float Y[4] = {2.0f, 3.0f, -1.0f, 1.0f};
static const double LR = 0.125;
static const float W0 = 0.5f;

/* Loss and gradient of one call at weight w with the rows split by torch.tensor_split into
 * `nmb` microbatches (sizes differ by at most one, larger first). */
static void hand_loss_grad(double w, int nmb, double *loss, double *grad) {
    int start = 0;
    *loss = 0.0;
    *grad = 0.0;
    for (int m = 0; m < nmb; ++m) {
        int size = 4 / nmb + (m < 4 % nmb ? 1 : 0);
        double l = 0.0, g = 0.0;
        for (int i = start; i < start + size; ++i) {
            double r = w * X[i] - Y[i];
            l += r * r;
            g += 2.0 * X[i] * r;
        }
        *loss += l / size;
        *grad += g / size;
        start += size;
    }
}

typedef struct fixture {
    rp_model *model;
    rp_loss *loss;
    rp_optimizer *sgd;
    rp_run_config *cfg;
    DLManagedTensor *x, *y;
} fixture;

static int setup(void **state) {
    static fixture f;
    f.model = ts_model(SPEC, 3, 2, NULL, 0);
    ts_set_master(f.model, 0, &W0, 1);
    TS_OK(rp_loss_create(&f.loss, RP_LOSS_MSE));
    TS_OK(rp_optimizer_create(&f.sgd, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(f.sgd, LR));
    f.cfg = ts_config(1, 0);
    int64_t shape[2] = {4, 1};
    f.x = ts_f32(2, shape, X);
    f.y = ts_f32(2, shape, Y);
    *state = &f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    rp_model_destroy(f->model);
    rp_loss_destroy(f->loss);
    rp_optimizer_destroy(f->sgd);
    rp_run_config_destroy(f->cfg);
    ts_free(f->x);
    ts_free(f->y);
    return 0;
}

static void assert_rel(const char *what, int t, double got, double want) {
    if (!(fabs(got - want) <= 1e-5 * fmax(fabs(want), 1e-3))) {
        print_error("%s at t=%d: got %.9g, expected %.9g\n", what, t, got, want);
        fail();
    }
}

static double fb(fixture *f, const rp_run_config *cfg) {
    const DLManagedTensor *inputs[1] = {f->x};
    double loss = 0.0;
    TS_OK(rp_forward_backward(&loss, NULL, f->model, inputs, 1, f->y, f->loss, cfg));
    return loss;
}

static double master(rp_model *model) {
    ts_params *p = ts_masters(model);
    double w = p->data[0][0];
    ts_params_free(p);
    return w;
}

/* Outputs of rp_forward, divided by x, give the weight in use. */
static double weight_in_use(fixture *f) {
    const DLManagedTensor *inputs[1] = {f->x};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, f->model, inputs, 1, f->cfg));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    float v[4];
    ts_read_f32(&o->dl_tensor, v);
    for (int i = 1; i < 4; ++i)
        assert_true(fabs(v[i] - v[0] * X[i]) <= 1e-6);
    ts_free(o);
    rp_tensor_list_destroy(outs);
    return v[0];
}

static void reset(fixture *f) {
    /* A fresh model each time keeps the optimizer state (and step count) of one test out of
     * the next. */
    rp_model_destroy(f->model);
    f->model = ts_model(SPEC, 3, 2, NULL, 0);
    ts_set_master(f->model, 0, &W0, 1);
}

static void sync_steps_use_the_latest_weights(void **state) {
    fixture *f = *state;
    reset(f);
    double w = W0;
    for (int t = 1; t <= 5; ++t) {
        double want_loss, g;
        hand_loss_grad(w, 1, &want_loss, &g);
        assert_rel("loss", t, fb(f, f->cfg), want_loss);
        TS_OK(rp_step(f->model, f->sgd, 0));
        w -= LR * g;
        assert_rel("weight in use after sync step", t, weight_in_use(f), w);
        assert_rel("master weight", t, master(f->model), w);
    }
    int64_t steps = 0;
    TS_OK(rp_model_step_count(&steps, f->model));
    assert_int_equal(steps, 5);
}

static void async_forward_backward_after_step_t_runs_on_weights_of_step_t_minus_1(void **state) {
    fixture *f = *state;
    reset(f);
    double w[7];
    w[0] = W0;
    for (int t = 1; t <= 6; ++t) {
        double want_loss, g;
        hand_loss_grad(w[t >= 2 ? t - 2 : 0], 1, &want_loss, &g);
        assert_rel("loss", t, fb(f, f->cfg), want_loss);
        TS_OK(rp_step(f->model, f->sgd, 1));
        w[t] = w[t - 1] - LR * g;
        /* rp_forward uses the published weights: those of step t - 1 until the next step. */
        assert_rel("weight in use after async step", t, weight_in_use(f), w[t - 1]);
    }
    int64_t steps = 0;
    TS_OK(rp_model_step_count(&steps, f->model));
    assert_int_equal(steps, 6);
    TS_OK(rp_synchronize(f->model));
    assert_rel("weight in use after rp_synchronize", 6, weight_in_use(f), w[6]);
    assert_rel("master weight after rp_synchronize", 6, master(f->model), w[6]);
}

static void synchronize_publishes_latest_weights_and_shows_grads_since_last_step(void **state) {
    fixture *f = *state;
    reset(f);
    double l0, g1, l1, g2;
    hand_loss_grad(W0, 1, &l0, &g1);
    fb(f, f->cfg);
    TS_OK(rp_step(f->model, f->sgd, 1));
    double w1 = W0 - LR * g1;
    /* Forward_backward after an async step: still on w0. */
    hand_loss_grad(W0, 1, &l1, &g2);
    assert_rel("loss of the call after async step 1", 2, fb(f, f->cfg), l1);
    TS_OK(rp_synchronize(f->model));
    assert_rel("master after synchronize", 1, master(f->model), w1);
    ts_params *g = ts_grads(f->model);
    assert_rel("gradient accumulated since step 1", 2, g->data[0][0], g2);
    ts_params_free(g);
    /* Now the call runs on w1. */
    double l2, g3;
    hand_loss_grad(w1, 1, &l2, &g3);
    assert_rel("loss after synchronize", 3, fb(f, f->cfg), l2);
    g = ts_grads(f->model);
    assert_rel("gradients accumulate across calls", 3, g->data[0][0], g2 + g3);
    ts_params_free(g);
    /* The next step consumes both calls' gradients. */
    TS_OK(rp_step(f->model, f->sgd, 0));
    assert_rel("master after sync step", 2, master(f->model), w1 - LR * (g2 + g3));
}

static void sync_step_after_async_steps_publishes_everything(void **state) {
    fixture *f = *state;
    reset(f);
    double l, g1, g2, g3, g4;
    hand_loss_grad(W0, 1, &l, &g1);
    assert_rel("loss", 1, fb(f, f->cfg), l);
    TS_OK(rp_step(f->model, f->sgd, 1));
    double w1 = W0 - LR * g1;
    hand_loss_grad(W0, 1, &l, &g2);
    assert_rel("loss", 2, fb(f, f->cfg), l);
    TS_OK(rp_step(f->model, f->sgd, 1));
    double w2 = w1 - LR * g2;
    hand_loss_grad(w1, 1, &l, &g3);
    assert_rel("loss", 3, fb(f, f->cfg), l);
    TS_OK(rp_step(f->model, f->sgd, 0)); /* sync: waits for step 2, runs step 3, publishes */
    double w3 = w2 - LR * g3;
    assert_rel("weight in use after sync step", 3, weight_in_use(f), w3);
    hand_loss_grad(w3, 1, &l, &g4);
    assert_rel("loss after sync step", 4, fb(f, f->cfg), l);
}

/* Same async contract with the default configuration: 2 CPU devices -> 3 microbatches of
 * 2, 1 and 1 rows, and SGD with momentum and weight decay (torch.optim.SGD:
 * d = g + wd w; buf = d at the first step, else momentum buf + d; w -= lr buf). */
static void async_sgd_momentum_with_default_microbatches(void **state) {
    fixture *f = *state;
    reset(f);
    const double mom = 0.5, wd = 0.1;
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(opt, LR));
    TS_OK(rp_optimizer_set_momentum(opt, mom));
    TS_OK(rp_optimizer_set_weight_decay(opt, wd));
    double w[6], buf = 0.0;
    w[0] = W0;
    for (int t = 1; t <= 5; ++t) {
        double want_loss, g;
        hand_loss_grad(w[t >= 2 ? t - 2 : 0], 3, &want_loss, &g);
        assert_rel("loss (3 microbatches)", t, fb(f, NULL), want_loss);
        TS_OK(rp_step(f->model, opt, 1));
        double d = g + wd * w[t - 1];
        buf = t == 1 ? d : mom * buf + d;
        w[t] = w[t - 1] - LR * buf;
    }
    TS_OK(rp_synchronize(f->model));
    assert_rel("master after synchronize", 5, master(f->model), w[5]);
    rp_optimizer_destroy(opt);
}

typedef struct sgd_data {
    double lr;
    int calls;
} sgd_data;

static int32_t hand_sgd(rp_model *model, void *user_data) {
    sgd_data *d = user_data;
    DLManagedTensor *w = NULL, *g = NULL;
    if (rp_param_master(&w, model, 0) != RP_OK || rp_param_grad(&g, model, 0) != RP_OK)
        return 1;
    float *wp = (float *)((char *)w->dl_tensor.data + w->dl_tensor.byte_offset);
    const float *gp = (const float *)((char *)g->dl_tensor.data + g->dl_tensor.byte_offset);
    wp[0] = (float)(wp[0] - d->lr * gp[0]);
    ++d->calls;
    w->deleter(w);
    g->deleter(g);
    return 0;
}

static void async_step_callback_has_the_same_staleness(void **state) {
    fixture *f = *state;
    reset(f);
    sgd_data d = {LR, 0};
    double w[6];
    w[0] = W0;
    for (int t = 1; t <= 5; ++t) {
        double want_loss, g;
        hand_loss_grad(w[t >= 2 ? t - 2 : 0], 1, &want_loss, &g);
        assert_rel("loss", t, fb(f, f->cfg), want_loss);
        TS_OK(rp_step_callback(f->model, hand_sgd, &d, 1));
        w[t] = w[t - 1] - LR * g;
    }
    TS_OK(rp_synchronize(f->model));
    assert_int_equal(d.calls, 5);
    assert_rel("master after synchronize", 5, master(f->model), w[5]);
    int64_t steps = 0;
    TS_OK(rp_model_step_count(&steps, f->model));
    assert_int_equal(steps, 5);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(sync_steps_use_the_latest_weights),
        cmocka_unit_test(async_forward_backward_after_step_t_runs_on_weights_of_step_t_minus_1),
        cmocka_unit_test(synchronize_publishes_latest_weights_and_shows_grads_since_last_step),
        cmocka_unit_test(sync_step_after_async_steps_publishes_everything),
        cmocka_unit_test(async_sgd_momentum_with_default_microbatches),
        cmocka_unit_test(async_step_callback_has_the_same_staleness),
    };
    return cmocka_run_group_tests_name("async", tests, setup, teardown);
}
