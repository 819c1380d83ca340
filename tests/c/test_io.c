/*
 * test_io.c - weights on disk: rp_model_save / rp_model_load.
 *
 * Files are checked with the reference's own safetensors reader (reference.cpp, nlohmann +
 * torch), and files for loading are written by the reference's writer, so neither side of a
 * round trip is trusted alone. fp32 weights must survive exactly (bitwise).
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct fixture {
    char *dir;
    char path[4096];
} fixture;

static int setup(void **state) {
    static fixture f;
    f.dir = ts_tempdir();
    snprintf(f.path, sizeof f.path, "%s/model.safetensors", f.dir);
    *state = &f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    ts_rmdir(f->dir);
    free(f->dir);
    return 0;
}

static int per_test_setup(void **state) {
    fixture *f = *state;
    ts_rmdir(f->dir);
    mkdir(f->dir, 0700);
    return 0;
}

static void train_one_step(rp_model *model, int async) {
    float x[8 * 5], y[8 * 2];
    ts_fill_uniform(x, 40, 1, -1.f, 1.f);
    ts_fill_uniform(y, 16, 2, -1.f, 1.f);
    int64_t xs[2] = {8, 5}, ys[2] = {8, 2};
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    const DLManagedTensor *inputs[1] = {in};
    TS_OK(rp_forward_backward(NULL, NULL, model, inputs, 1, lab, loss, NULL));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 0.05));
    TS_OK(rp_step(model, opt, async));
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
    ts_free(in);
    ts_free(lab);
}

static int params_differ(const ts_params *a, const ts_params *b) {
    for (size_t i = 0; i < a->count; ++i)
        if (memcmp(a->data[i], b->data[i], sizeof(float) * a->numel[i]))
            return 1;
    return 0;
}

static void save_then_load_into_a_model_with_another_seed_restores_weights_exactly(void **state) {
    fixture *f = *state;
    rp_model *a = ts_model(TS_DISK_SPEC, 1, 2, NULL, 0);
    train_one_step(a, 0);
    TS_OK(rp_model_save(a, f->path));
    rp_model *b = ts_model(TS_DISK_SPEC, 2, 1, NULL, 0);
    ts_params *wa = ts_masters(a), *wb = ts_masters(b);
    assert_true(params_differ(wa, wb)); /* another seed, other weights */
    ts_params_free(wb);
    TS_OK(rp_model_load(b, f->path));
    wb = ts_masters(b);
    ts_assert_params_equal(wb, wa);
    /* The loaded weights are the ones in use, not only the master copy. */
    ref_model *ref = ts_reference_from(a, TS_DISK_SPEC, 1);
    float x[6 * 5], got[6 * 2], want[6 * 2];
    ts_fill_uniform(x, 30, 9, -1.f, 1.f);
    int64_t xs[2] = {6, 5};
    DLManagedTensor *in = ts_f32(2, xs, x);
    const DLManagedTensor *inputs[1] = {in};
    rp_tensor_list *outs = NULL;
    TS_OK(rp_forward(&outs, b, inputs, 1, NULL));
    DLManagedTensor *o = NULL;
    TS_OK(rp_tensor_list_get(&o, outs, 0));
    ts_read_f32(&o->dl_tensor, got);
    ref_tensor rin = {x, 0, 2, xs};
    int64_t n = 0;
    assert_int_equal(ref_forward(ref, want, 12, &n, &rin, 2), 0);
    assert_true(ts_rel_err(got, want, 12, 1e-6) <= 1e-5);
    ts_free(o);
    rp_tensor_list_destroy(outs);
    ts_free(in);
    ref_destroy(ref);
    /* Atomic write: only the target is left in the folder. */
    assert_int_equal(ts_dir_entries(f->dir), 1);
    ts_params_free(wa);
    ts_params_free(wb);
    rp_model_destroy(a);
    rp_model_destroy(b);
}

static void saved_file_is_safetensors_with_parameter_names_shapes_and_f32_values(void **state) {
    fixture *f = *state;
    rp_model *a = ts_model(TS_DISK_SPEC, 3, 1, NULL, 0);
    train_one_step(a, 1); /* async: save must synchronize first and write the latest weights */
    TS_OK(rp_model_save(a, f->path));
    ts_params *w = ts_masters(a);
    ref_st *st = ref_st_open(f->path);
    if (!st) {
        print_error("reference reader: %s\n", ref_last_error());
        fail();
    }
    assert_int_equal(ref_st_count(st), w->count);
    for (size_t i = 0; i < w->count; ++i) {
        const char *dtype = ref_st_dtype(st, w->names[i]);
        assert_non_null(dtype);
        assert_string_equal(dtype, "F32");
        int64_t shape[8], pshape[8];
        int32_t nd = ref_st_shape(st, w->names[i], shape, 8), pnd = 0;
        TS_OK(rp_param_shape(pshape, &pnd, 8, a, i));
        assert_int_equal(nd, pnd);
        for (int32_t d = 0; d < nd; ++d)
            assert_int_equal(shape[d], pshape[d]);
        float *v = malloc(sizeof(float) * w->numel[i]);
        assert_int_equal(ref_st_get_f32(st, w->names[i], v, w->numel[i]), 0);
        assert_memory_equal(v, w->data[i], sizeof(float) * w->numel[i]);
        free(v);
    }
    ref_st_close(st);
    ts_params_free(w);
    rp_model_destroy(a);
}

/* Any float dtype loads, converted to fp32. Values k/64 are exact in F16 and BF16. */
static void load_converts_f64_f16_and_bf16_files(void **state) {
    fixture *f = *state;
    static const char *DTYPES[] = {"F64", "F16", "BF16", "F32"};
    rp_model *a = ts_model(TS_DISK_SPEC, 4, 1, NULL, 0);
    ts_params *w = ts_masters(a);
    for (size_t k = 0; k < 4; ++k) {
        ref_st_entry *e = calloc(w->count, sizeof *e);
        int64_t(*shapes)[8] = calloc(w->count, sizeof *shapes);
        float **vals = calloc(w->count, sizeof(float *));
        for (size_t i = 0; i < w->count; ++i) {
            int32_t nd = 0;
            TS_OK(rp_param_shape(shapes[i], &nd, 8, a, i));
            vals[i] = malloc(sizeof(float) * w->numel[i]);
            for (int64_t j = 0; j < w->numel[i]; ++j)
                vals[i][j] = (float)((int)((j * 37 + i * 11 + k) % 129) - 64) / 64.0f;
            /* Mix dtypes within one file too: the first tensor is always F32. */
            e[i] = (ref_st_entry){w->names[i], i == 0 ? "F32" : DTYPES[k], nd, shapes[i], vals[i]};
        }
        assert_int_equal(ref_st_write(f->path, e, w->count), 0);
        TS_OK(rp_model_load(a, f->path));
        ts_params *got = ts_masters(a);
        for (size_t i = 0; i < w->count; ++i)
            assert_memory_equal(got->data[i], vals[i], sizeof(float) * w->numel[i]);
        ts_params_free(got);
        for (size_t i = 0; i < w->count; ++i)
            free(vals[i]);
        free(vals);
        free(shapes);
        free(e);
    }
    ts_params_free(w);
    rp_model_destroy(a);
}

/* Loading drops accumulated gradients and keeps AdamW's moments and step count: the step
 * after the load equals the reference's second step from the loaded weights. */
static void load_drops_gradients_and_keeps_optimizer_state(void **state) {
    fixture *f = *state;
    rp_model *src = ts_model(TS_DISK_SPEC, 5, 1, NULL, 0);
    TS_OK(rp_model_save(src, f->path));
    ts_params *loaded = ts_masters(src);
    rp_model_destroy(src);

    rp_model *a = ts_model(TS_DISK_SPEC, 6, 2, NULL, 0);
    ref_model *ref = ts_reference_from(a, TS_DISK_SPEC, 6);
    float x[8 * 5], y[8 * 2];
    ts_fill_uniform(x, 40, 1, -1.f, 1.f);
    ts_fill_uniform(y, 16, 2, -1.f, 1.f);
    int64_t xs[2] = {8, 5}, ys[2] = {8, 2};
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, ys, y);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    rp_run_config *cfg = ts_config(2, 0);
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 0.05));
    ref_tensor rin = {x, 0, 2, xs}, rlab = {y, 0, 2, ys};
    ref_fb_args args = {rin, &rlab, 2, 0, 0, 0, REF_LOSS_MSE, 1.0};

    TS_OK(rp_forward_backward(NULL, NULL, a, inputs, 1, lab, loss, cfg));
    TS_OK(rp_step(a, opt, 0));
    assert_int_equal(ref_forward_backward(ref, NULL, NULL, 0, NULL, &args), 0);
    assert_int_equal(ref_step_adamw(ref, 0.05, 0.9, 0.999, 1e-8, 1e-2), 0);

    TS_OK(rp_forward_backward(NULL, NULL, a, inputs, 1, lab, loss, cfg)); /* dropped by load */
    TS_OK(rp_model_load(a, f->path));
    ts_params *g = ts_grads(a);
    for (size_t i = 0; i < g->count; ++i)
        for (int64_t j = 0; j < g->numel[i]; ++j)
            assert_true(g->data[i][j] == 0.0f);
    ts_params_free(g);
    for (size_t i = 0; i < loaded->count; ++i)
        assert_int_equal(ref_set_param(ref, loaded->names[i], loaded->data[i], loaded->numel[i]),
                         0);

    TS_OK(rp_forward_backward(NULL, NULL, a, inputs, 1, lab, loss, cfg));
    TS_OK(rp_step(a, opt, 0));
    args.call_index = 2;
    assert_int_equal(ref_forward_backward(ref, NULL, NULL, 0, NULL, &args), 0);
    assert_int_equal(ref_step_adamw(ref, 0.05, 0.9, 0.999, 1e-8, 1e-2), 0);
    ts_assert_masters_match(a, ref, 1e-4, "weights of the step after load");
    ts_params_free(loaded);
    rp_optimizer_destroy(opt);
    rp_run_config_destroy(cfg);
    rp_loss_destroy(loss);
    ts_free(in);
    ts_free(lab);
    ref_destroy(ref);
    rp_model_destroy(a);
}

static char *read_file(const char *path, size_t *size) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc(n > 0 ? (size_t)n : 1);
    *size = fread(buf, 1, (size_t)n, fp);
    fclose(fp);
    return buf;
}

static void save_to_a_missing_folder_is_an_io_error_naming_the_path(void **state) {
    fixture *f = *state;
    rp_model *a = ts_model(TS_DISK_SPEC, 7, 1, NULL, 0);
    char path[4200];
    snprintf(path, sizeof path, "%s/no/such/dir/m.safetensors", f->dir);
    TS_ERR(rp_model_save(a, path), RP_ERR_IO, "no/such/dir");
    assert_int_equal(ts_dir_entries(f->dir), 0);
    ts_assert_trains_like_reference(a, TS_DISK_SPEC, 5, 2);
    rp_model_destroy(a);
}

/* A write that fails half-way (file size limit, which binds root too) must leave the old file
 * as it was and no temporary file behind. */
static void failed_save_leaves_the_old_file_intact_and_no_temporary(void **state) {
    fixture *f = *state;
    rp_model *a = ts_model(TS_DISK_SPEC, 8, 1, NULL, 0);
    TS_OK(rp_model_save(a, f->path));
    size_t old_size = 0;
    char *old = read_file(f->path, &old_size);
    assert_non_null(old);
    assert_true(old_size > 256);
    train_one_step(a, 0); /* new weights, so a partial overwrite would show */

    struct rlimit saved;
    assert_int_equal(getrlimit(RLIMIT_FSIZE, &saved), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = saved;
    small.rlim_cur = 128;
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &small), 0);
    rp_status s = rp_model_save(a, f->path);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &saved), 0);
    signal(SIGXFSZ, prev);
    if (s != RP_ERR_IO) {
        print_error("save beyond the file size limit returned %d (%s): %s\n", (int)s,
                    rp_status_string(s), msg);
        fail();
    }
    assert_true(ts_contains(msg, f->dir));

    size_t now_size = 0;
    char *now = read_file(f->path, &now_size);
    assert_non_null(now);
    assert_int_equal(now_size, old_size);
    assert_memory_equal(now, old, old_size);
    assert_int_equal(ts_dir_entries(f->dir), 1);
    free(old);
    free(now);

    /* A folder in the way of the target: the rename fails, the folder stays, nothing is left. */
    char dirpath[4200];
    snprintf(dirpath, sizeof dirpath, "%s/taken.safetensors", f->dir);
    assert_int_equal(mkdir(dirpath, 0700), 0);
    char inner[4300];
    snprintf(inner, sizeof inner, "%s/keep", dirpath);
    FILE *fp = fopen(inner, "w");
    assert_non_null(fp);
    fclose(fp);
    TS_ERR(rp_model_save(a, dirpath), RP_ERR_IO, "taken.safetensors");
    assert_int_equal(ts_dir_entries(f->dir), 2);
    assert_int_equal(ts_dir_entries(dirpath), 1);

    /* And the model still saves where it can. */
    TS_OK(rp_model_save(a, f->path));
    assert_int_equal(ts_dir_entries(f->dir), 2);
    rp_model_destroy(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(
            save_then_load_into_a_model_with_another_seed_restores_weights_exactly, per_test_setup),
        cmocka_unit_test_setup(saved_file_is_safetensors_with_parameter_names_shapes_and_f32_values,
                               per_test_setup),
        cmocka_unit_test_setup(load_converts_f64_f16_and_bf16_files, per_test_setup),
        cmocka_unit_test_setup(load_drops_gradients_and_keeps_optimizer_state, per_test_setup),
        cmocka_unit_test_setup(save_to_a_missing_folder_is_an_io_error_naming_the_path,
                               per_test_setup),
        cmocka_unit_test_setup(failed_save_leaves_the_old_file_intact_and_no_temporary,
                               per_test_setup),
    };
    return cmocka_run_group_tests_name("io", tests, setup, teardown);
}
