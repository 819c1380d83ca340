/*
 * test_reference.c - checks the test oracle itself (reference/reference.cpp), without the
 * library: gradients against central finite differences, closed forms for a 1 -> 1 linear
 * model, the SplitMix64 constants of docs/semantics.md, dropout mask properties, the
 * tensor_split rule, and the safetensors writer/reader round trip.
 */
/* cmocka.h needs these first */
// clang-format off
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
// clang-format on

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "reference/reference.h"

static void fill(float *out, int n, uint32_t seed, float lo, float hi) {
    for (int i = 0; i < n; ++i) {
        seed = seed * 1664525u + 1013904223u;
        out[i] = lo + (hi - lo) * (float)(seed >> 8) / 16777216.0f;
    }
}

static void mix_is_splitmix64(void **state) {
    (void)state;
    /* SplitMix64's first output for state 0 is mix(0) (Vigna's reference implementation). */
    assert_true(ref_mix(0) == 0xE220A8397B1DCDAFull);
    assert_true(ref_mix(1) != ref_mix(2));
}

static void linear_1x1_matches_closed_form(void **state) {
    (void)state;
    ref_model *r = ref_create("{\"layers\": [{\"type\": \"linear\", \"in\": 1, \"out\": 1, "
                              "\"bias\": false}]}",
                              0);
    assert_non_null(r);
    assert_int_equal(ref_param_count(r), 1);
    assert_string_equal(ref_param_name(r, 0), "0.weight");
    float w = 0.5f, x[4] = {1, 2, -1, 0.5f}, y[4] = {2, 3, -1, 1};
    assert_int_equal(ref_set_param(r, "0.weight", &w, 1), 0);
    int64_t s[2] = {4, 1};
    ref_tensor rx = {x, 0, 2, s}, ry = {y, 0, 2, s};
    /* 3 microbatches of 2, 1, 1 rows (tensor_split). */
    ref_fb_args a = {rx, &ry, 3, 0, 0, 0, REF_LOSS_MSE, 2.0};
    double loss = 0;
    assert_int_equal(ref_forward_backward(r, &loss, NULL, 0, NULL, &a), 0);
    double want = 0, grad = 0;
    int start[3] = {0, 2, 3}, size[3] = {2, 1, 1};
    for (int m = 0; m < 3; ++m) {
        double l = 0, g = 0;
        for (int i = start[m]; i < start[m] + size[m]; ++i) {
            l += (0.5 * x[i] - y[i]) * (0.5 * x[i] - y[i]);
            g += 2 * x[i] * (0.5 * x[i] - y[i]);
        }
        want += 2.0 * l / size[m];
        grad += 2.0 * g / size[m];
    }
    assert_true(fabs(loss - want) < 1e-6 * fabs(want));
    float g = 0;
    assert_int_equal(ref_get_grad(r, "0.weight", &g, 1), 0);
    assert_true(fabs(g - grad) < 1e-5 * fabs(grad));
    /* SGD with momentum 0.9: first step w -= lr g. */
    assert_int_equal(ref_step_sgd(r, 0.1, 0.9, 0.0), 0);
    float w1 = 0;
    assert_int_equal(ref_get_param(r, "0.weight", &w1, 1), 0);
    assert_true(fabs(w1 - (0.5 - 0.1 * grad)) < 1e-6);
    assert_int_equal(ref_get_grad(r, "0.weight", &g, 1), 0);
    assert_true(g == 0.0f);
    ref_destroy(r);
}

/* Every gradient of a model with every layer kind against central differences of the loss
 * (fp32 forward, step 1e-2 relative to typical weights: agreement to about 1e-2). */
static void gradients_match_finite_differences(void **state) {
    (void)state;
    const char *spec =
        "{\"layers\": ["
        "{\"type\": \"linear\", \"in\": 3, \"out\": 6},"
        "{\"type\": \"layer_norm\", \"dim\": 6},"
        "{\"type\": \"gelu\"},"
        "{\"type\": \"residual_mlp\", \"dim\": 6, \"hidden\": 5, \"norm\": \"rms_norm\","
        " \"activation\": \"silu\"},"
        "{\"type\": \"rms_norm\", \"dim\": 6},"
        "{\"type\": \"tanh\"},"
        "{\"type\": \"reshape\", \"shape\": [2, 3]},"
        "{\"type\": \"flatten\"},"
        "{\"type\": \"linear\", \"in\": 6, \"out\": 2}]}";
    ref_model *r = ref_create(spec, 0);
    assert_non_null(r);
    size_t n = ref_param_count(r);
    for (size_t i = 0; i < n; ++i) {
        const char *name = ref_param_name(r, i);
        int64_t k = ref_param_numel(r, name);
        float *v = malloc(sizeof(float) * k);
        fill(v, (int)k, (uint32_t)(i + 1), -0.6f, 0.6f);
        if (strstr(name, "norm") || !strcmp(name, "1.weight") || !strcmp(name, "4.weight"))
            for (int64_t j = 0; j < k; ++j)
                v[j] += 1.0f;
        assert_int_equal(ref_set_param(r, name, v, k), 0);
        free(v);
    }
    float x[5 * 3], y[5 * 2];
    fill(x, 15, 77, -1, 1);
    fill(y, 10, 78, -1, 1);
    int64_t xs[2] = {5, 3}, ys[2] = {5, 2};
    ref_tensor rx = {x, 0, 2, xs}, ry = {y, 0, 2, ys};
    ref_fb_args a = {rx, &ry, 2, 0, 0, 0, REF_LOSS_MSE, 1.0};
    double base = 0;
    assert_int_equal(ref_forward_backward(r, &base, NULL, 0, NULL, &a), 0);
    float *grads[16];
    assert_true(n <= 16);
    for (size_t i = 0; i < n; ++i) {
        const char *name = ref_param_name(r, i);
        int64_t k = ref_param_numel(r, name);
        grads[i] = malloc(sizeof(float) * k);
        assert_int_equal(ref_get_grad(r, name, grads[i], k), 0);
    }
    for (size_t i = 0; i < n; ++i) {
        const char *name = ref_param_name(r, i);
        int64_t k = ref_param_numel(r, name);
        float *v = malloc(sizeof(float) * k), *g = grads[i];
        float *fd = malloc(sizeof(float) * k);
        assert_int_equal(ref_get_param(r, name, v, k), 0);
        for (int64_t j = 0; j < k; ++j) {
            const float h = 1e-2f;
            float keep = v[j];
            double lp = 0, lm = 0;
            v[j] = keep + h; /* (the gradients these calls accumulate are not used) */
            ref_set_param(r, name, v, k);
            assert_int_equal(ref_forward_backward(r, &lp, NULL, 0, NULL, &a), 0);
            v[j] = keep - h;
            ref_set_param(r, name, v, k);
            assert_int_equal(ref_forward_backward(r, &lm, NULL, 0, NULL, &a), 0);
            v[j] = keep;
            ref_set_param(r, name, v, k);
            fd[j] = (float)((lp - lm) / (2 * h));
        }
        double num = 0, den = 0;
        for (int64_t j = 0; j < k; ++j) {
            num += (g[j] - fd[j]) * (g[j] - fd[j]);
            den += fd[j] * fd[j];
        }
        if (!(sqrt(num) <= 2e-2 * fmax(sqrt(den), 1e-3))) {
            print_error("%s: autograd vs finite differences %.3g relative\n", name,
                        sqrt(num) / fmax(sqrt(den), 1e-3));
            fail();
        }
        free(v);
        free(g);
        free(fd);
    }
    ref_destroy(r);
}

/* Dropout: about p of the elements are dropped, survivors scaled by 1/(1-p); the mask is a
 * function of (seed, call, layer, microbatch); evaluation mode is the identity. */
static void dropout_masks_follow_the_seeding_rule(void **state) {
    (void)state;
    const char *spec = "{\"layers\": [{\"type\": \"relu\"}, {\"type\": \"dropout\", \"p\": 0.25}]}";
    ref_model *r = ref_create(spec, 123);
    assert_non_null(r);
    enum { N = 4000 };
    static float x[N], o1[N], o2[N], o3[N];
    for (int i = 0; i < N; ++i)
        x[i] = 1.0f + (float)(i % 7);
    int64_t s[2] = {N / 4, 4};
    ref_tensor rx = {x, 0, 2, s};
    static float zeros[N];
    ref_tensor rz = {zeros, 0, 2, s};
    ref_fb_args a = {rx, &rz, 1, 0, 0, 5, REF_LOSS_MSE, 1.0};
    if (ref_forward_backward(r, NULL, o1, N, NULL, &a) != 0) {
        print_error("reference: %s\n", ref_last_error());
        fail();
    }
    assert_int_equal(ref_forward_backward(r, NULL, o2, N, NULL, &a), 0);
    a.call_index = 6;
    assert_int_equal(ref_forward_backward(r, NULL, o3, N, NULL, &a), 0);
    int dropped = 0, differ = 0;
    for (int i = 0; i < N; ++i) {
        assert_true(o1[i] == o2[i]);
        if (o1[i] == 0.0f)
            ++dropped;
        else
            assert_true(fabsf(o1[i] - x[i] / 0.75f) <= 1e-6f * x[i]);
        if ((o1[i] == 0.0f) != (o3[i] == 0.0f))
            ++differ;
    }
    assert_true(dropped > 0.2 * N && dropped < 0.3 * N);
    assert_true(differ > 0.2 * N);
    float e[N];
    assert_int_equal(ref_forward(r, e, N, NULL, &rx, 3), 0);
    assert_memory_equal(e, x, sizeof e);
    ref_destroy(r);
}

static void safetensors_round_trip(void **state) {
    (void)state;
    char path[] = "/tmp/rp-ref-st-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    float a[6] = {1, -2, 0.5f, 0.25f, 3, -0.125f}, b[3] = {7, 8, 9};
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    ref_st_entry e[2] = {{"0.weight", "BF16", 2, sa, a}, {"x.y", "F64", 1, sb, b}};
    assert_int_equal(ref_st_write(path, e, 2), 0);
    ref_st *f = ref_st_open(path);
    assert_non_null(f);
    assert_int_equal(ref_st_count(f), 2);
    assert_string_equal(ref_st_dtype(f, "0.weight"), "BF16");
    assert_string_equal(ref_st_dtype(f, "x.y"), "F64");
    int64_t shape[4];
    assert_int_equal(ref_st_shape(f, "0.weight", shape, 4), 2);
    assert_int_equal(shape[0], 2);
    assert_int_equal(shape[1], 3);
    float got[6];
    assert_int_equal(ref_st_get_f32(f, "0.weight", got, 6), 0);
    assert_memory_equal(got, a, sizeof a);
    assert_int_equal(ref_st_get_f32(f, "x.y", got, 3), 0);
    assert_memory_equal(got, b, sizeof b);
    assert_null(ref_st_dtype(f, "nope"));
    ref_st_close(f);
    unlink(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(mix_is_splitmix64),
        cmocka_unit_test(linear_1x1_matches_closed_form),
        cmocka_unit_test(gradients_match_finite_differences),
        cmocka_unit_test(dropout_masks_follow_the_seeding_rule),
        cmocka_unit_test(safetensors_round_trip),
    };
    return cmocka_run_group_tests_name("reference", tests, NULL, NULL);
}
