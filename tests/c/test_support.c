#define _GNU_SOURCE
#include "test_support.h"

#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const DLDataType TS_F32 = {kDLFloat, 32, 1};
const DLDataType TS_F64 = {kDLFloat, 64, 1};
const DLDataType TS_I64 = {kDLInt, 64, 1};
const DLDataType TS_I32 = {kDLInt, 32, 1};
const DLDataType TS_F16 = {kDLFloat, 16, 1};
const DLDevice TS_CPU = {kDLCPU, 0};
const DLDevice TS_CUDA0 = {kDLCUDA, 0};

#define TS_MAX_DIMS 8

typedef struct ts_holder {
    DLManagedTensor mt;
    int64_t shape[TS_MAX_DIMS];
    int64_t strides[TS_MAX_DIMS];
    void *buf;
} ts_holder;

static void ts_deleter(DLManagedTensor *self) {
    ts_holder *h = (ts_holder *)self->manager_ctx;
    free(h->buf);
    free(h);
}

DLManagedTensor *ts_raw(DLDataType dtype, DLDevice device, int32_t ndim, const int64_t *shape,
                        const int64_t *strides, size_t bytes) {
    assert_true(ndim >= 0 && ndim <= TS_MAX_DIMS);
    ts_holder *h = calloc(1, sizeof *h);
    assert_non_null(h);
    h->buf = calloc(1, bytes ? bytes : 1);
    assert_non_null(h->buf);
    for (int32_t d = 0; d < ndim; ++d) {
        h->shape[d] = shape[d];
        if (strides)
            h->strides[d] = strides[d];
    }
    h->mt.dl_tensor.data = h->buf;
    h->mt.dl_tensor.device = device;
    h->mt.dl_tensor.ndim = ndim;
    h->mt.dl_tensor.dtype = dtype;
    h->mt.dl_tensor.shape = h->shape;
    h->mt.dl_tensor.strides = strides ? h->strides : NULL;
    h->mt.dl_tensor.byte_offset = 0;
    h->mt.manager_ctx = h;
    h->mt.deleter = ts_deleter;
    return &h->mt;
}

static int64_t numel_of(int32_t ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int32_t d = 0; d < ndim; ++d)
        n *= shape[d];
    return n;
}

int64_t ts_numel(const DLTensor *t) { return numel_of(t->ndim, t->shape); }

/* A CPU tensor of `dtype` (`size` bytes an element) holding a copy of `values` (NULL: zeros). */
static DLManagedTensor *copy_tensor(DLDataType dtype, size_t size, int32_t ndim,
                                    const int64_t *shape, const void *values) {
    int64_t n = numel_of(ndim, shape);
    DLManagedTensor *t = ts_raw(dtype, TS_CPU, ndim, shape, NULL, (size_t)n * size);
    if (values)
        memcpy(t->dl_tensor.data, values, (size_t)n * size);
    return t;
}

DLManagedTensor *ts_f32(int32_t ndim, const int64_t *shape, const float *values) {
    return copy_tensor(TS_F32, sizeof(float), ndim, shape, values);
}

DLManagedTensor *ts_i64(int32_t ndim, const int64_t *shape, const int64_t *values) {
    return copy_tensor(TS_I64, sizeof(int64_t), ndim, shape, values);
}

DLManagedTensor *ts_f64(int32_t ndim, const int64_t *shape, const float *values) {
    int64_t n = numel_of(ndim, shape);
    DLManagedTensor *t = ts_raw(TS_F64, TS_CPU, ndim, shape, NULL, (size_t)n * sizeof(double));
    double *d = t->dl_tensor.data;
    for (int64_t i = 0; i < n; ++i)
        d[i] = values ? values[i] : 0.0;
    return t;
}

/* Offset (in elements) of logical row-major index `flat` under `strides`. */
static int64_t strided_offset(int32_t ndim, const int64_t *shape, const int64_t *strides,
                              int64_t flat) {
    int64_t off = 0;
    for (int32_t d = ndim - 1; d >= 0; --d) {
        int64_t i = flat % shape[d];
        flat /= shape[d];
        off += i * strides[d];
    }
    return off;
}

DLManagedTensor *ts_f32_strided(int32_t ndim, const int64_t *shape, const int64_t *strides,
                                const float *values) {
    int64_t n = numel_of(ndim, shape), extent = 1;
    for (int32_t d = 0; d < ndim; ++d)
        extent += (shape[d] - 1) * strides[d];
    DLManagedTensor *t = ts_raw(TS_F32, TS_CPU, ndim, shape, strides, (size_t)extent * 4);
    float *data = t->dl_tensor.data;
    for (int64_t i = 0; i < n; ++i)
        data[strided_offset(ndim, shape, strides, i)] = values[i];
    return t;
}

void ts_free(DLManagedTensor *t) {
    if (t && t->deleter)
        t->deleter(t);
}

void ts_read_f32(const DLTensor *t, float *out) {
    assert_int_equal(t->dtype.code, kDLFloat);
    assert_int_equal(t->dtype.bits, 32);
    assert_int_equal(t->dtype.lanes, 1);
    assert_int_equal(t->device.device_type, kDLCPU);
    const float *data = (const float *)((const char *)t->data + t->byte_offset);
    int64_t n = ts_numel(t);
    if (!t->strides) {
        memcpy(out, data, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; ++i)
        out[i] = data[strided_offset(t->ndim, t->shape, t->strides, i)];
}

void ts_fill_uniform(float *out, int64_t n, uint64_t seed, float lo, float hi) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; ++i) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out[i] = lo + (hi - lo) * (float)((s >> 40) * (1.0 / 16777216.0));
    }
}

/* ---- status assertions ------------------------------------------------------------------- */

void ts_ok(rp_status status, const char *expr, const char *file, int line) {
    if (status == RP_OK)
        return;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    print_error("%s returned %d (%s): %s\n", expr, (int)status, rp_status_string(status), msg);
    _fail(file, line);
}

static int ci_strstr(const char *hay, const char *needle, size_t nlen) {
    size_t hlen = strlen(hay);
    if (nlen == 0)
        return 1;
    for (size_t i = 0; i + nlen <= hlen; ++i) {
        size_t j = 0;
        while (j < nlen && tolower((unsigned char)hay[i + j]) == tolower((unsigned char)needle[j]))
            ++j;
        if (j == nlen)
            return 1;
    }
    return 0;
}

int ts_contains(const char *haystack, const char *alternatives) {
    const char *p = alternatives;
    for (;;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (ci_strstr(haystack, p, len))
            return 1;
        if (!bar)
            return 0;
        p = bar + 1;
    }
}

void ts_err(rp_status status, rp_status expected, const char *expr, const char *file, int line,
            const char *const *needles) {
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    if (status != expected) {
        print_error("%s returned %d (%s), expected %d (%s); message: \"%s\"\n", expr, (int)status,
                    rp_status_string(status), (int)expected, rp_status_string(expected), msg);
        _fail(file, line);
    }
    if (msg[0] == '\0') {
        print_error("%s returned %d but the error message is empty\n", expr, (int)status);
        _fail(file, line);
    }
    for (const char *const *n = needles; *n; ++n) {
        if (!ts_contains(msg, *n)) {
            print_error("%s: message \"%s\" does not mention \"%s\"\n", expr, msg, *n);
            _fail(file, line);
        }
    }
}

/* ---- models ------------------------------------------------------------------------------- */

int32_t ts_device_kind(void) {
    const char *d = getenv("RP_TEST_DEVICE");
    return (d && strcmp(d, "cuda") == 0) ? RP_DEVICE_CUDA : RP_DEVICE_CPU;
}

int ts_gpu_missing(void) {
    if (ts_device_kind() != RP_DEVICE_CUDA)
        return 0;
    int32_t gpus = 0;
    if (rp_cuda_device_count(&gpus) == RP_OK && gpus > 0)
        return 0;
    printf("no CUDA device visible: skipping\n");
    return 1;
}

int32_t ts_devices(int32_t wanted) {
    if (ts_device_kind() != RP_DEVICE_CUDA)
        return wanted;
    int32_t gpus = 0;
    TS_OK(rp_cuda_device_count(&gpus));
    return wanted > gpus ? gpus : wanted;
}

rp_model_options *ts_options(uint64_t seed, int32_t devices) {
    devices = ts_devices(devices);
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_OK(rp_model_options_set_seed(opts, seed));
    TS_OK(rp_model_options_set_devices(opts, ts_device_kind(), devices));
    return opts;
}

/* rp_model_create and rp_model_create_from_hf_config: a model from JSON text and options. */
typedef rp_status (*model_from_text)(rp_model **, const char *, const rp_model_options *);

static rp_model *create_with_options(model_from_text create, const char *text,
                                     rp_model_options *options) {
    rp_model *model = NULL;
    TS_OK(create(&model, text, options));
    rp_model_options_destroy(options);
    assert_non_null(model);
    return model;
}

rp_model *ts_model_with_options(const char *spec, rp_model_options *options) {
    return create_with_options(rp_model_create, spec, options);
}

rp_model *ts_hf_model_with_options(const char *config, rp_model_options *options) {
    return create_with_options(rp_model_create_from_hf_config, config, options);
}

rp_model *ts_model(const char *spec, uint64_t seed, int32_t devices, const int32_t *plan,
                   size_t plan_len) {
    rp_model_options *opts = ts_options(seed, devices);
    if (plan)
        TS_OK(rp_model_options_set_stage_plan(opts, plan, plan_len));
    return ts_model_with_options(spec, opts);
}

rp_run_config *ts_config(int32_t num_microbatch, int32_t grain) {
    rp_run_config *c = NULL;
    TS_OK(rp_run_config_create(&c));
    if (num_microbatch)
        TS_OK(rp_run_config_set_num_microbatch(c, num_microbatch));
    if (grain)
        TS_OK(rp_run_config_set_recompute_grain(c, grain));
    return c;
}

rp_optimizer *ts_adamw(double lr) {
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, lr));
    return opt;
}

static ts_params *params_alloc(size_t count) {
    ts_params *p = calloc(1, sizeof *p);
    p->count = count;
    p->names = calloc(count ? count : 1, sizeof(char *));
    p->numel = calloc(count ? count : 1, sizeof(int64_t));
    p->data = calloc(count ? count : 1, sizeof(float *));
    return p;
}

static ts_params *snapshot(rp_model *model, int grads) {
    TS_OK(rp_synchronize(model));
    size_t count = 0;
    TS_OK(rp_param_count(&count, model));
    ts_params *p = params_alloc(count);
    for (size_t i = 0; i < count; ++i) {
        const char *name = NULL;
        TS_OK(rp_param_name(&name, model, i));
        p->names[i] = strdup(name);
        DLManagedTensor *t = NULL;
        if (grads)
            TS_OK(rp_param_grad(&t, model, i));
        else
            TS_OK(rp_param_master(&t, model, i));
        p->numel[i] = ts_numel(&t->dl_tensor);
        p->data[i] = malloc((size_t)(p->numel[i] ? p->numel[i] : 1) * sizeof(float));
        ts_read_f32(&t->dl_tensor, p->data[i]);
        ts_free(t);
    }
    return p;
}

ts_params *ts_masters(rp_model *model) { return snapshot(model, 0); }
ts_params *ts_grads(rp_model *model) { return snapshot(model, 1); }

void ts_params_free(ts_params *p) {
    if (!p)
        return;
    for (size_t i = 0; i < p->count; ++i) {
        free(p->names[i]);
        free(p->data[i]);
    }
    free(p->names);
    free(p->numel);
    free(p->data);
    free(p);
}

void ts_assert_params_equal(const ts_params *a, const ts_params *b) {
    assert_int_equal(a->count, b->count);
    for (size_t i = 0; i < a->count; ++i) {
        assert_string_equal(a->names[i], b->names[i]);
        assert_int_equal(a->numel[i], b->numel[i]);
        if (memcmp(a->data[i], b->data[i], (size_t)a->numel[i] * sizeof(float)) != 0) {
            print_error("parameter %s differs (expected bitwise equal; rel err %.3g)\n",
                        a->names[i], ts_rel_err(a->data[i], b->data[i], a->numel[i], 1e-30));
            fail();
        }
    }
}

double ts_rel_err(const float *a, const float *b, int64_t n, double floor) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    num = sqrt(num);
    den = sqrt(den);
    if (isnan(num))
        return INFINITY;
    return num / (den > floor ? den : floor);
}

void ts_assert_params_close(const ts_params *a, const ts_params *b, double tol, const char *what) {
    assert_int_equal(a->count, b->count);
    int bad = 0;
    for (size_t i = 0; i < a->count; ++i) {
        assert_string_equal(a->names[i], b->names[i]);
        assert_int_equal(a->numel[i], b->numel[i]);
        double e = ts_rel_err(a->data[i], b->data[i], a->numel[i], 1e-6);
        if (!(e <= tol)) {
            print_error("%s of %s: relative error %.3g > %.1g (got[0]=%.9g expected[0]=%.9g)\n",
                        what, a->names[i], e, tol, a->data[i][0], b->data[i][0]);
            bad = 1;
        }
    }
    if (bad)
        fail();
}

int64_t ts_param_numel(const rp_model *model, size_t index) {
    int64_t shape[8];
    int32_t ndim = 0;
    TS_OK(rp_param_shape(shape, &ndim, 8, model, index));
    int64_t n = 1;
    for (int32_t d = 0; d < ndim; ++d)
        n *= shape[d];
    return n;
}

void ts_set_master(rp_model *model, size_t index, const float *values, int64_t numel) {
    TS_OK(rp_synchronize(model));
    DLManagedTensor *t = NULL;
    TS_OK(rp_param_master(&t, model, index));
    assert_int_equal(ts_numel(&t->dl_tensor), numel);
    if (t->dl_tensor.strides) { /* the master weight is documented as a plain fp32 tensor */
        int64_t expect = 1;
        for (int32_t d = t->dl_tensor.ndim - 1; d >= 0; --d) {
            if (t->dl_tensor.shape[d] != 1)
                assert_int_equal(t->dl_tensor.strides[d], expect);
            expect *= t->dl_tensor.shape[d];
        }
    }
    memcpy((char *)t->dl_tensor.data + t->dl_tensor.byte_offset, values,
           (size_t)numel * sizeof(float));
    ts_free(t);
    TS_OK(rp_synchronize(model));
}

/* ---- the reference ------------------------------------------------------------------------ */

ref_model *ts_reference_from(rp_model *model, const char *spec, uint64_t seed) {
    ref_model *ref = ref_create(spec, seed);
    if (!ref) {
        print_error("reference: %s\n", ref_last_error());
        fail();
    }
    ts_params *w = ts_masters(model);
    if (w->count != ref_param_count(ref)) {
        print_error("model has %zu parameters, the spec implies %zu\n", w->count,
                    ref_param_count(ref));
        fail();
    }
    for (size_t i = 0; i < w->count; ++i) {
        /* Names and order are those of docs/semantics.md, which the reference follows. */
        assert_string_equal(w->names[i], ref_param_name(ref, i));
        int64_t shape[8], rshape[8];
        int32_t ndim = 0;
        TS_OK(rp_param_shape(shape, &ndim, 8, model, i));
        int32_t rndim = ref_param_shape(ref, w->names[i], rshape, 8);
        assert_int_equal(ndim, rndim);
        for (int32_t d = 0; d < ndim; ++d)
            assert_int_equal(shape[d], rshape[d]);
        assert_int_equal(w->numel[i], ref_param_numel(ref, w->names[i]));
        if (ref_set_param(ref, w->names[i], w->data[i], w->numel[i]) != 0) {
            print_error("reference: %s\n", ref_last_error());
            fail();
        }
    }
    ts_params_free(w);
    return ref;
}

ts_params *ts_ref_params(const ref_model *ref, int grads) {
    size_t count = ref_param_count(ref);
    ts_params *p = params_alloc(count);
    for (size_t i = 0; i < count; ++i) {
        const char *name = ref_param_name(ref, i);
        p->names[i] = strdup(name);
        p->numel[i] = ref_param_numel(ref, name);
        p->data[i] = malloc((size_t)p->numel[i] * sizeof(float));
        int rc = grads ? ref_get_grad(ref, name, p->data[i], p->numel[i])
                       : ref_get_param(ref, name, p->data[i], p->numel[i]);
        if (rc != 0) {
            print_error("reference: %s\n", ref_last_error());
            fail();
        }
    }
    return p;
}

static void assert_match(ts_params *got, const ref_model *ref, int grads, double tol,
                         const char *what) {
    ts_params *want = ts_ref_params(ref, grads);
    ts_assert_params_close(got, want, tol, what);
    ts_params_free(got);
    ts_params_free(want);
}

void ts_assert_masters_match(rp_model *model, const ref_model *ref, double tol, const char *what) {
    assert_match(ts_masters(model), ref, 0, tol, what);
}

void ts_assert_grads_match(rp_model *model, const ref_model *ref, double tol, const char *what) {
    assert_match(ts_grads(model), ref, 1, tol, what);
}

double ts_ref_mse_call(ref_model *ref, const float *x, const float *y, int64_t rows, int64_t in,
                       int64_t out, int32_t num_microbatch, int64_t call_index) {
    const int64_t xs[2] = {rows, in}, ys[2] = {rows, out};
    ref_tensor rin = {x, 0, 2, xs}, rlab = {y, 0, 2, ys};
    ref_fb_args a = {rin, &rlab, num_microbatch, 0, 0, call_index, REF_LOSS_MSE, 1.0};
    double loss = 0.0;
    if (ref_forward_backward(ref, &loss, NULL, 0, NULL, &a) != 0) {
        print_error("reference: %s\n", ref_last_error());
        fail();
    }
    return loss;
}

void ts_assert_loss_close(double got, double want, double rel, int it) {
    if (!(fabs(got - want) <= rel * fabs(want))) {
        print_error("iteration %d: loss %.9g, reference %.9g\n", it, got, want);
        fail();
    }
}

void ts_assert_masters_follow_bf16_state(rp_model *model, const ref_model *ref, int step,
                                         const char *first_what) {
    ts_params *w = ts_masters(model), *rw = ts_ref_params(ref, 0);
    double worst = 0.0;
    for (size_t p = 0; p < w->count; ++p)
        for (int64_t i = 0; i < w->numel[p]; ++i)
            worst = fmax(worst, fabs((double)w->data[p][i] - rw->data[p][i]));
    if (step == 0)
        ts_assert_params_close(w, rw, 1e-5, first_what);
    else if (!(worst <= 1e-3)) {
        print_error("step %d: largest weight difference %.3g > 1e-3\n", step + 1, worst);
        fail();
    }
    ts_params_free(w);
    ts_params_free(rw);
}

void ts_assert_trains_like_reference(rp_model *model, const char *spec, int64_t in_features,
                                     int64_t out_features) {
    enum { ROWS = 8 };
    const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 1e-2;
    float *x = malloc(sizeof(float) * ROWS * in_features);
    float *y = malloc(sizeof(float) * ROWS * out_features);
    ts_fill_uniform(x, ROWS * in_features, 4242, -1.f, 1.f);
    ts_fill_uniform(y, ROWS * out_features, 4343, -1.f, 1.f);
    int64_t xs[2] = {ROWS, in_features}, ys[2] = {ROWS, out_features};
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    ref_model *ref = ts_reference_from(model, spec, 0);
    rp_run_config *cfg = ts_config(2, 0);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_optimizer *opt = ts_adamw(lr);
    TS_OK(rp_zero_grad(model));
    double first = 0.0, last = 0.0;
    for (int it = 0; it < 3; ++it) {
        double got = 0.0;
        const DLManagedTensor *inputs[1] = {in};
        TS_OK(rp_forward_backward(&got, NULL, model, inputs, 1, lab, loss, cfg));
        /* k = 0 throughout: the model holds no dropout */
        double want = ts_ref_mse_call(ref, x, y, ROWS, in_features, out_features, 2, 0);
        ts_assert_loss_close(got, want, 1e-5, it);
        if (it == 0)
            first = got;
        last = got;
        TS_OK(rp_step(model, opt, 0));
        assert_int_equal(ref_step_adamw(ref, lr, b1, b2, eps, wd), 0);
    }
    assert_true(last < first);
    ts_assert_masters_match(model, ref, 1e-4, "weights after AdamW");
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    rp_run_config_destroy(cfg);
    ref_destroy(ref);
    ts_free(in);
    ts_free(lab);
    free(x);
    free(y);
}

/* ---- files and Hugging Face names --------------------------------------------------------- */

const char *const TS_DISK_SPEC = "{\"layers\": ["
                                 "{\"type\": \"linear\", \"in\": 5, \"out\": 9},"
                                 "{\"type\": \"layer_norm\", \"dim\": 9},"
                                 "{\"type\": \"residual_mlp\", \"dim\": 9, \"hidden\": 13},"
                                 "{\"type\": \"linear\", \"in\": 9, \"out\": 2, \"bias\": false}]}";

const char *const TS_QWEN3_CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 40, \"hidden_size\": 32,"
    " \"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 8, \"tie_word_embeddings\": false,"
    " \"dtype\": \"float32\"}";

void ts_hf_name(char *out, size_t cap, const char *ours, int num_layers) {
    char *end = NULL;
    long layer = strtol(ours, &end, 10);
    const char *local = end + 1;
    if (layer == 0)
        snprintf(out, cap, "model.embed_tokens.%s", local);
    else if (layer <= num_layers)
        snprintf(out, cap, "model.layers.%ld.%s", layer - 1, local);
    else if (layer == num_layers + 1)
        snprintf(out, cap, "model.norm.%s", local);
    else
        snprintf(out, cap, "lm_head.%s", local);
}

char *ts_tempdir(void) {
    char tmpl[] = "/tmp/rp-test-XXXXXX";
    char *d = mkdtemp(tmpl);
    assert_non_null(d);
    return strdup(d);
}

void ts_rmdir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (unlink(path) != 0) {
            ts_rmdir(path); /* a directory made by a test */
        }
    }
    closedir(d);
    rmdir(dir);
}

int ts_dir_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            ++n;
    closedir(d);
    return n;
}

void ts_assert_all_zero(const ts_params *p) {
    for (size_t k = 0; k < p->count; ++k)
        for (int64_t i = 0; i < p->numel[k]; ++i)
            if (p->data[k][i] != 0.0f) {
                print_error("%s[%lld] = %g, want 0\n", p->names[k], (long long)i, p->data[k][i]);
                fail();
            }
}

/* ---- the tripwire layer -------------------------------------------------------------------- */

const char *const TS_TRIPWIRE_SPEC =
    "{\"layers\": [{\"type\": \"linear\", \"in\": 6, \"out\": 24}, {\"type\": \"tanh\"},"
    " {\"type\": \"caller\", \"def\": 0},"
    " {\"type\": \"linear\", \"in\": 24, \"out\": 24}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 24, \"out\": 24}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 24, \"out\": 3}]}";

const char *const TS_MLP_SPEC =
    "{\"layers\": [{\"type\": \"linear\", \"in\": 6, \"out\": 24}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 24, \"out\": 24}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 24, \"out\": 24}, {\"type\": \"tanh\"},"
    " {\"type\": \"linear\", \"in\": 24, \"out\": 3}]}";

/* An fp32 copy of a host tensor of fp32 or bf16 values, through its strides if any. */
static DLManagedTensor *copy_as_f32(const DLTensor *t) {
    const int64_t n = ts_numel(t);
    float *values = malloc(sizeof(float) * (size_t)(n ? n : 1));
    const char *base = (const char *)t->data + t->byte_offset;
    for (int64_t i = 0; i < n; ++i) {
        int64_t offset = i; /* element i in row-major order */
        if (t->strides) {
            offset = 0;
            for (int64_t d = t->ndim - 1, rest = i; d >= 0; --d) {
                offset += (rest % t->shape[d]) * t->strides[d];
                rest /= t->shape[d];
            }
        }
        if (t->dtype.bits == 16) { /* bf16: the high half of an fp32 */
            const uint32_t bits = (uint32_t)((const uint16_t *)base)[offset] << 16;
            memcpy(&values[i], &bits, sizeof bits);
        } else {
            values[i] = ((const float *)base)[offset];
        }
    }
    DLManagedTensor *out = ts_f32(t->ndim, t->shape, values);
    free(values);
    return out;
}

static int32_t tripwire_forward(rp_tensor_list *out, void **inout_context,
                                const rp_layer_call *call, const DLManagedTensor *const *inputs,
                                size_t n_inputs, void *ud) {
    (void)call;
    (void)ud;
    (void)n_inputs;
    if (inout_context)
        *inout_context = NULL;
    return rp_tensor_list_push(out, copy_as_f32(&inputs[0]->dl_tensor)) == RP_OK ? 0 : 1;
}

static int32_t tripwire_backward(rp_tensor_list *in_grads, rp_tensor_list *param_grads, void *ctx,
                                 const rp_layer_call *call, const DLManagedTensor *const *out_grads,
                                 size_t n_outputs, void *ud) {
    (void)param_grads;
    (void)ctx;
    (void)n_outputs;
    int32_t microbatch = -1;
    rp_layer_call_info(NULL, NULL, NULL, NULL, NULL, &microbatch, NULL, call);
    if (*(const int *)ud && microbatch == 1)
        return 5;
    return rp_tensor_list_push(in_grads, copy_as_f32(&out_grads[0]->dl_tensor)) == RP_OK ? 0 : 1;
}

rp_layer_def *ts_tripwire_def(int *fail) {
    rp_layer_def *def = NULL;
    TS_OK(rp_layer_def_create(&def, "c:tripwire", tripwire_forward, tripwire_backward, NULL,
                              fail));
    return def;
}

rp_model *ts_tripwire_model(int *fail, rp_model_options *options) {
    rp_layer_def *def = ts_tripwire_def(fail);
    TS_OK(rp_model_options_set_devices(options, RP_DEVICE_CPU, 3));
    const int32_t plan[4] = {3, 2, 2, 1};
    TS_OK(rp_model_options_set_stage_plan(options, plan, 4));
    rp_model *m = NULL;
    TS_OK(rp_model_create_with_layers(&m, TS_TRIPWIRE_SPEC, (const rp_layer_def *const *)&def, 1,
                                      options));
    rp_model_options_destroy(options);
    rp_layer_def_destroy(def);
    return m;
}
