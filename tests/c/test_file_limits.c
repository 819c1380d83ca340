/*
 * test_file_limits.c - checkpoints whose declared sizes are too large, do not fit the file or
 * overflow: every one is refused with RP_ERR_IO and a message naming the file and the offending
 * value before anything is allocated, and tensors the model does not use are never read. The
 * model is unchanged after each refusal and still trains.
 *
 * The files are written here byte by byte (header text, then data), since well-formed writers
 * cannot produce them; large tensors are holes in sparse files, so they cost no disk. While a
 * load runs, the data segment is capped at its size plus 2 GiB (RLIMIT_DATA), so a loader that
 * allocated or read a declared 8 GiB tensor would fail the call instead of exhausting the machine.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define GIB8 8589934592ull /* 2^31 fp32 elements */

typedef struct fixture {
    char *dir;
    rp_model *model; /* the spec model every rp_model_load is tried on */
    ts_params *w0;   /* its weights, which no refused load may change */
    rp_model *hf;    /* a Hugging Face model for rp_model_load_hf */
    ts_params *hf0;
} fixture;

/* ---- writing files by hand ------------------------------------------------------------------ */

/* One tensor of a hand-made file: the header entry's text and the bytes behind it. */
typedef struct item {
    char name[128];
    const char *dtype;
    char shape[128];   /* JSON array text */
    uint64_t nbytes;   /* bytes given to it in the data area */
    const float *data; /* NULL: a hole (sparse) */
} item;

static void write_bytes_at(int fd, const void *data, size_t n, off_t at) {
    assert_int_equal(pwrite(fd, data, n, at), (ssize_t)n);
}

/* A safetensors file: `header` (NULL: built from the items, laid out one after another), then
 * `data_bytes` data bytes (0: what the items need). */
static void write_st(const char *path, const item *items, size_t n, const char *header,
                     uint64_t data_bytes) {
    char *h = malloc(1 << 16);
    uint64_t offset = 0;
    if (header) {
        snprintf(h, 1 << 16, "%s", header);
    } else {
        snprintf(h, 1 << 16, "{");
        for (size_t i = 0; i < n; ++i) {
            size_t len = strlen(h);
            snprintf(h + len, (1 << 16) - len,
                     "%s\"%s\": {\"dtype\": \"%s\", \"shape\": %s, \"data_offsets\": [%llu, %llu]}",
                     i ? ", " : "", items[i].name, items[i].dtype, items[i].shape,
                     (unsigned long long)offset, (unsigned long long)(offset + items[i].nbytes));
            offset += items[i].nbytes;
        }
        strcat(h, "}");
    }
    if (data_bytes == 0)
        data_bytes = offset;
    const uint64_t hlen = strlen(h);
    unsigned char len_bytes[8];
    for (int i = 0; i < 8; ++i)
        len_bytes[i] = (unsigned char)(hlen >> (8 * i));
    int fd = open(path, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    assert_true(fd >= 0);
    write_bytes_at(fd, len_bytes, 8, 0);
    write_bytes_at(fd, h, hlen, 8);
    offset = 0;
    for (size_t i = 0; i < n && !header; ++i) {
        if (items[i].data)
            write_bytes_at(fd, items[i].data, items[i].nbytes, (off_t)(8 + hlen + offset));
        offset += items[i].nbytes;
    }
    assert_int_equal(ftruncate(fd, (off_t)(8 + hlen + data_bytes)), 0);
    assert_int_equal(close(fd), 0);
    free(h);
}

/* The items of every parameter of `model` with the values of `w` (names: `hf` ? Hugging Face
 * names : ours). Returns the count. */
static size_t model_items(item *out, rp_model *model, const ts_params *w, int hf) {
    for (size_t i = 0; i < w->count; ++i) {
        const char *name = w->names[i];
        if (hf)
            TS_OK(rp_param_hf_name(&name, model, i));
        snprintf(out[i].name, sizeof out[i].name, "%s", name);
        out[i].dtype = "F32";
        int64_t shape[8];
        int32_t nd = 0;
        TS_OK(rp_param_shape(shape, &nd, 8, model, i));
        snprintf(out[i].shape, sizeof out[i].shape, "[");
        for (int32_t d = 0; d < nd; ++d) {
            size_t len = strlen(out[i].shape);
            snprintf(out[i].shape + len, sizeof out[i].shape - len, "%s%lld", d ? ", " : "",
                     (long long)shape[d]);
        }
        strcat(out[i].shape, "]");
        out[i].nbytes = sizeof(float) * (uint64_t)w->numel[i];
        out[i].data = w->data[i];
    }
    return w->count;
}

static item huge_item(const char *name) {
    item it;
    memset(&it, 0, sizeof it);
    snprintf(it.name, sizeof it.name, "%s", name);
    it.dtype = "F32";
    snprintf(it.shape, sizeof it.shape, "[2147483648]");
    it.nbytes = GIB8;
    return it;
}

static void write_text(const char *path, const char *text) {
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
}

/* ---- memory and read accounting ------------------------------------------------------------- */

static long long proc_field(const char *file, const char *key) {
    FILE *fp = fopen(file, "r");
    if (!fp)
        return -1;
    char line[256];
    long long v = -1;
    size_t klen = strlen(key);
    while (fgets(line, sizeof line, fp))
        if (strncmp(line, key, klen) == 0) {
            v = atoll(line + klen);
            break;
        }
    fclose(fp);
    return v;
}

/* Bytes this process has read through read() and friends (-1 where /proc does not say). */
static long long bytes_read(void) { return proc_field("/proc/self/io", "rchar:"); }

/* Caps the data segment (heap and private writable mappings) at its size now plus 2 GiB, so an
 * allocation of a declared 8 GiB tensor fails. Not under AddressSanitizer, whose shadow memory
 * counts too. Returns 1 when capped (restore with uncap_data). */
static int cap_data(struct rlimit *saved) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    (void)saved;
    return 0;
#else
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||                         \
    __has_feature(memory_sanitizer)
    (void)saved;
    return 0;
#endif
#endif
    long long kib = proc_field("/proc/self/status", "VmData:");
    if (kib <= 0 || getrlimit(RLIMIT_DATA, saved) != 0)
        return 0;
    struct rlimit cap = *saved;
    cap.rlim_cur = (rlim_t)kib * 1024 + (rlim_t)(2ull << 30);
    if (saved->rlim_max != RLIM_INFINITY && cap.rlim_cur > saved->rlim_max)
        return 0;
    if (saved->rlim_cur != RLIM_INFINITY && cap.rlim_cur > saved->rlim_cur)
        return 0;
    return setrlimit(RLIMIT_DATA, &cap) == 0;
#endif
}

static void uncap_data(int capped, const struct rlimit *saved) {
    if (capped)
        assert_int_equal(setrlimit(RLIMIT_DATA, saved), 0);
}

/* ---- fixture -------------------------------------------------------------------------------- */

static int setup(void **state) {
    static fixture f;
    f.dir = ts_tempdir();
    f.model = ts_model(TS_DISK_SPEC, 11, 1, NULL, 0);
    f.w0 = ts_masters(f.model);
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_seed(o, 3));
    TS_OK(rp_model_options_set_devices(o, ts_device_kind(), 1));
    TS_OK(rp_model_create_from_hf_config(&f.hf, TS_QWEN3_CONFIG, o));
    rp_model_options_destroy(o);
    f.hf0 = ts_masters(f.hf);
    *state = &f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    ts_params_free(f->w0);
    ts_params_free(f->hf0);
    rp_model_destroy(f->model);
    rp_model_destroy(f->hf);
    ts_rmdir(f->dir);
    free(f->dir);
    return 0;
}

static char *path_in(const fixture *f, const char *name) {
    char *p = malloc(4096);
    snprintf(p, 4096, "%s/%s", f->dir, name);
    return p;
}

static void assert_unchanged(const fixture *f) {
    ts_params *now = ts_masters(f->model);
    ts_assert_params_equal(now, f->w0);
    ts_params_free(now);
    now = ts_masters(f->hf);
    ts_assert_params_equal(now, f->hf0);
    ts_params_free(now);
}

/* rp_model_load(`path`) fails with RP_ERR_IO naming the file and each needle, under the cap. */
#define ASSERT_LOAD_REFUSED(f, path, ...)                                                          \
    do {                                                                                           \
        struct rlimit saved_;                                                                      \
        int capped_ = cap_data(&saved_);                                                           \
        rp_status s_ = rp_model_load((f)->model, (path));                                          \
        char msg_[2048];                                                                           \
        snprintf(msg_, sizeof msg_, "%s", rp_last_error_message());                                \
        uncap_data(capped_, &saved_);                                                              \
        ts_err(s_, RP_ERR_IO, "rp_model_load", __FILE__, __LINE__, (const char *[]){NULL});        \
        const char *needles_[] = {(path), __VA_ARGS__, NULL};                                      \
        for (const char **n_ = needles_; *n_; ++n_)                                                \
            if (!ts_contains(msg_, *n_))                                                           \
                fail_msg("message \"%s\" lacks \"%s\"", msg_, *n_);                                \
        assert_unchanged(f);                                                                       \
    } while (0)

/* ---- the tests ------------------------------------------------------------------------------ */

/* A sparse file declaring an 8 GiB tensor the model does not have, before and between the
 * model's own: the load succeeds, reads a few kilobytes and allocates nothing large. */
static void unused_8_gib_tensor_of_a_sparse_file_is_never_read(void **state) {
    fixture *f = *state;
    rp_model *src = ts_model(TS_DISK_SPEC, 12, 1, NULL, 0);
    ts_params *w = ts_masters(src);
    item items[16];
    items[0] = huge_item("unused.huge");
    size_t n = 1 + model_items(items + 1, src, w, 0);
    items[n] = items[2]; /* one of the model's tensors after the hole, too */
    items[2] = huge_item("unused.huge2");
    ++n;
    char *path = path_in(f, "sparse.safetensors");
    write_st(path, items, n, NULL, 0);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_true((uint64_t)st.st_size > 2 * GIB8);

    struct rlimit saved;
    int capped = cap_data(&saved);
    long long before = bytes_read();
    rp_status s = rp_model_load(f->model, path);
    long long after = bytes_read();
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    uncap_data(capped, &saved);
    if (s != RP_OK)
        fail_msg("load of a file with an unused 8 GiB tensor: %s: %s", rp_status_string(s), msg);
    if (before >= 0 && after >= 0 && after - before > (64ll << 20))
        fail_msg("the load read %lld bytes; the model needs %llu", after - before,
                 (unsigned long long)(st.st_size - 2 * GIB8));
    ts_params *got = ts_masters(f->model);
    ts_assert_params_equal(got, w);
    ts_params_free(got);

    /* Back to the fixture's weights, through a plain file. */
    char *good = path_in(f, "good.safetensors");
    n = model_items(items, f->model, f->w0, 0);
    write_st(good, items, n, NULL, 0);
    TS_OK(rp_model_load(f->model, good));
    assert_unchanged(f);
    free(good);
    free(path);
    ts_params_free(w);
    rp_model_destroy(src);
}

/* The same through the Hugging Face reader, which maps the files: a checkpoint directory with an
 * unused 8 GiB hole loads into an existing model and builds a new one. */
static void unused_8_gib_tensor_of_a_hugging_face_checkpoint_is_never_read(void **state) {
    fixture *f = *state;
    char *dir = path_in(f, "hf_sparse");
    assert_int_equal(mkdir(dir, 0700), 0);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, TS_QWEN3_CONFIG);
    item items[64];
    items[0] = huge_item("model.unused.huge");
    size_t n = 1 + model_items(items + 1, f->hf, f->hf0, 1);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    write_st(path, items, n, NULL, 0);

    struct rlimit saved;
    int capped = cap_data(&saved);
    rp_status s = rp_model_load_hf(f->hf, dir);
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", rp_last_error_message());
    rp_model *built = NULL;
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, ts_device_kind(), 1));
    rp_status s2 = rp_model_create_from_hf(&built, dir, o);
    rp_model_options_destroy(o);
    uncap_data(capped, &saved);
    if (s != RP_OK || s2 != RP_OK)
        fail_msg("Hugging Face load with an unused 8 GiB tensor: %s / %s: %s", rp_status_string(s),
                 rp_status_string(s2), msg);
    assert_unchanged(f); /* the same values went in */
    ts_params *b = ts_masters(built);
    ts_assert_params_equal(b, f->hf0);
    ts_params_free(b);
    rp_model_destroy(built);
    free(dir);
}

/* A tensor the model has, declared as 8 GiB: refused from the header, nothing allocated. */
static void used_tensor_declared_as_8_gib_is_refused_before_allocation(void **state) {
    fixture *f = *state;
    item items[16];
    size_t n = model_items(items, f->model, f->w0, 0);
    items[0] = huge_item(f->w0->names[0]);
    char *path = path_in(f, "huge_used.safetensors");
    write_st(path, items, n, NULL, 0);
    ASSERT_LOAD_REFUSED(f, path, f->w0->names[0], "2147483648", "expects");
    free(path);
}

/* Offsets that point past the data the file really has (a truncated or lying file), offsets
 * backwards, and sizes that disagree with the shape. */
static void declared_sizes_beyond_the_file_are_io_errors(void **state) {
    fixture *f = *state;
    char *path = path_in(f, "short.safetensors");
    write_st(path, NULL, 0,
             "{\"0.weight\": {\"dtype\": \"F32\", \"shape\": [9, 5], \"data_offsets\": [0, 180]}}",
             100);
    ASSERT_LOAD_REFUSED(f, path, "0.weight", "180", "100 data bytes");
    /* An unused tensor claiming 4 GiB of a file of 1 KiB. */
    write_st(path, NULL, 0,
             "{\"big\": {\"dtype\": \"F32\", \"shape\": [1073741824], "
             "\"data_offsets\": [0, 4294967296]}}",
             1024);
    ASSERT_LOAD_REFUSED(f, path, "big", "4294967296", "1024 data bytes");
    write_st(path, NULL, 0,
             "{\"0.weight\": {\"dtype\": \"F32\", \"shape\": [9, 5], \"data_offsets\": [180, 0]}}",
             1024);
    ASSERT_LOAD_REFUSED(f, path, "0.weight", "[180, 0]");
    write_st(path, NULL, 0,
             "{\"0.weight\": {\"dtype\": \"F32\", \"shape\": [9, 5], \"data_offsets\": [0, 100]}}",
             1024);
    ASSERT_LOAD_REFUSED(f, path, "0.weight", "100 bytes", "180");
    /* A header length larger than the file. */
    write_st(path, NULL, 0, "{}", 0);
    int fd = open(path, O_WRONLY);
    const unsigned char len[8] = {0, 0, 0, 0, 1, 0, 0, 0}; /* 2^32 */
    write_bytes_at(fd, len, 8, 0);
    close(fd);
    ASSERT_LOAD_REFUSED(f, path, "header length 4294967296");
    free(path);
}

/* Shapes whose element count or byte size does not fit int64, including ones that wrap around
 * to a small or zero size: refused with the shape named, whether or not the model uses them. */
static void shape_products_overflowing_int64_are_io_errors(void **state) {
    fixture *f = *state;
    static const struct {
        const char *name, *shape, *needle;
    } cases[] = {
        {"unused.wraps_to_zero", "[4294967296, 4294967296]", "overflow"},
        {"0.weight", "[4294967296, 4294967296]", "overflow"},
        {"unused.wraps_to_small", "[4294967297, 4294967297, 4294967297]", "overflow"},
        {"unused.elements_fit_bytes_do_not", "[2305843009213693952]", "overflow"},
        {"unused.four", "[4611686018427387904, 4]", "overflow"},
        {"unused.beyond_int64", "[9223372036854775808]", "not a size"},
        {"unused.negative", "[-1]", "not a size"},
    };
    char *path = path_in(f, "overflow.safetensors");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        char header[512];
        snprintf(header, sizeof header,
                 "{\"%s\": {\"dtype\": \"F32\", \"shape\": %s, \"data_offsets\": [0, 0]}}",
                 cases[c].name, cases[c].shape);
        write_st(path, NULL, 0, header, 64);
        char shape_text[128]; /* the message shows the shape as JSON, without spaces */
        size_t k = 0;
        for (const char *s = cases[c].shape; *s && k + 1 < sizeof shape_text; ++s)
            if (*s != ' ')
                shape_text[k++] = *s;
        shape_text[k] = '\0';
        ASSERT_LOAD_REFUSED(f, path, cases[c].name, shape_text, cases[c].needle);
    }
    free(path);
}

/* JSON numbers beyond double's range (1e400) in a safetensors header or a Hugging Face index
 * are a corrupt file (RP_ERR_IO naming the value), not an internal error. */
static void json_numbers_out_of_range_are_io_errors(void **state) {
    fixture *f = *state;
    char *path = path_in(f, "range.safetensors");
    write_st(path, NULL, 0,
             "{\"0.weight\": {\"dtype\": \"F32\", \"shape\": [1e400], \"data_offsets\": [0, 0]}}",
             64);
    ASSERT_LOAD_REFUSED(f, path, "1e400");
    write_st(path, NULL, 0,
             "{\"__metadata__\": {\"x\": -1e400}, \"0.weight\": {\"dtype\": \"F32\", "
             "\"shape\": [9, 5], \"data_offsets\": [0, 180]}}",
             180);
    ASSERT_LOAD_REFUSED(f, path, "1e400");
    free(path);

    /* An index with total_size 1e400. */
    char *dir = path_in(f, "hf_range");
    assert_int_equal(mkdir(dir, 0700), 0);
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_text(p, TS_QWEN3_CONFIG);
    item items[64];
    size_t n = model_items(items, f->hf, f->hf0, 1);
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    write_st(p, items, n, NULL, 0);
    char *index = malloc(1 << 16);
    snprintf(index, 1 << 16, "{\"metadata\": {\"total_size\": 1e400}, \"weight_map\": {");
    for (size_t i = 0; i < n; ++i) {
        size_t len = strlen(index);
        snprintf(index + len, (1 << 16) - len, "%s\"%s\": \"a.safetensors\"", i ? ", " : "",
                 items[i].name);
    }
    strcat(index, "}}");
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_text(p, index);
    TS_ERR(rp_model_load_hf(f->hf, dir), RP_ERR_IO, "model.safetensors.index.json", "1e400");
    assert_unchanged(f);
    /* And in the shard's own header. */
    write_text(p, "{\"weight_map\": {\"model.norm.weight\": \"a.safetensors\"}}");
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    write_st(p, NULL, 0,
             "{\"model.norm.weight\": {\"dtype\": \"F32\", \"shape\": [32], "
             "\"data_offsets\": [0, 1e400]}}",
             128);
    TS_ERR(rp_model_load_hf(f->hf, dir), RP_ERR_IO, "a.safetensors", "1e400");
    assert_unchanged(f);
    free(index);
    free(dir);
}

/* A folder or a device where a file is expected: a clear message, the same every time. */
static void loading_a_directory_or_a_device_is_an_io_error_saying_so(void **state) {
    fixture *f = *state;
    ASSERT_LOAD_REFUSED(f, f->dir, "directory");
    char first[2048];
    snprintf(first, sizeof first, "%s", rp_last_error_message());
    ASSERT_LOAD_REFUSED(f, f->dir, "directory");
    assert_string_equal(first, rp_last_error_message());
    ASSERT_LOAD_REFUSED(f, "/dev/null", "not a regular file");

    /* A Hugging Face directory whose model.safetensors is a folder. */
    char *dir = path_in(f, "hf_folder");
    assert_int_equal(mkdir(dir, 0700), 0);
    char p[4200];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    assert_int_equal(mkdir(p, 0700), 0);
    TS_ERR(rp_model_load_hf(f->hf, dir), RP_ERR_IO, "model.safetensors", "directory");
    assert_unchanged(f);
    free(dir);
}

/* After all the refusals the model is intact and trains like the reference. */
static void model_trains_after_every_refusal(void **state) {
    fixture *f = *state;
    assert_unchanged(f);
    ts_assert_trains_like_reference(f->model, TS_DISK_SPEC, 5, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(unused_8_gib_tensor_of_a_sparse_file_is_never_read),
        cmocka_unit_test(unused_8_gib_tensor_of_a_hugging_face_checkpoint_is_never_read),
        cmocka_unit_test(used_tensor_declared_as_8_gib_is_refused_before_allocation),
        cmocka_unit_test(declared_sizes_beyond_the_file_are_io_errors),
        cmocka_unit_test(shape_products_overflowing_int64_are_io_errors),
        cmocka_unit_test(json_numbers_out_of_range_are_io_errors),
        cmocka_unit_test(loading_a_directory_or_a_device_is_an_io_error_saying_so),
        cmocka_unit_test(model_trains_after_every_refusal),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
