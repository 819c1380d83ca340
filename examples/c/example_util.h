/*
 * example_util.h - small helpers shared by the C examples: status checking, borrowed DLPack
 * tensors over plain C arrays, reading an output tensor back, a progress display and a scratch
 * folder.
 *
 * Not part of the RoundPipe API: copy what you need into your own program.
 */
#ifndef ROUNDPIPE_EXAMPLE_UTIL_H
#define ROUNDPIPE_EXAMPLE_UTIL_H

#include <roundpipe.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* mkdtemp, rmdir: define _POSIX_C_SOURCE 200809L before any include */

/* Every fallible RoundPipe call returns an rp_status; on failure the library keeps a message for
 * the calling thread. The examples stop at the first failure and say which call failed and why. */
#define CHECK(call) example_check((call), #call, __FILE__, __LINE__)

static inline void example_check(rp_status status, const char *what, const char *file, int line) {
    if (status == RP_OK)
        return;
    fprintf(stderr, "%s:%d: %s failed: %s (%d): %s\n", file, line, what, rp_status_string(status),
            (int)status, rp_last_error_message());
    exit(EXIT_FAILURE);
}

/* A DLPack view of a caller-owned C array, borrowed by RoundPipe for the duration of a call.
 * RoundPipe never calls the deleter of an input, so it is NULL; the struct must not move while a
 * call uses it (the shape pointer points into it). */
typedef struct example_tensor {
    DLManagedTensor managed;
    int64_t shape[4];
} example_tensor;

static inline void example_tensor_init(example_tensor *t, void *data, DLDataTypeCode code,
                                       uint8_t bits, int32_t ndim, const int64_t *shape) {
    memset(t, 0, sizeof(*t));
    memcpy(t->shape, shape, (size_t)ndim * sizeof(int64_t));
    t->managed.dl_tensor.data = data;
    t->managed.dl_tensor.device.device_type = kDLCPU;
    t->managed.dl_tensor.device.device_id = 0;
    t->managed.dl_tensor.ndim = ndim;
    t->managed.dl_tensor.dtype.code = (uint8_t)code;
    t->managed.dl_tensor.dtype.bits = bits;
    t->managed.dl_tensor.dtype.lanes = 1;
    t->managed.dl_tensor.shape = t->shape;
    t->managed.dl_tensor.strides = NULL; /* NULL strides: compact row-major */
    t->managed.dl_tensor.byte_offset = 0;
    t->managed.manager_ctx = NULL;
    t->managed.deleter = NULL;
}

static inline void example_tensor_f32(example_tensor *t, float *data, int32_t ndim,
                                      const int64_t *shape) {
    example_tensor_init(t, data, kDLFloat, 32, ndim, shape);
}

static inline void example_tensor_i64(example_tensor *t, int64_t *data, int32_t ndim,
                                      const int64_t *shape) {
    example_tensor_init(t, data, kDLInt, 64, ndim, shape);
}

/* Copy output `index` of `list` (an fp32 CPU tensor, as rp_forward returns by default) into a
 * fresh malloc'd array of *out_count floats, honouring strides. Returns NULL (after printing why)
 * when the tensor is not what the examples expect. The DLPack reference taken here is released
 * with its deleter before returning, as the API asks. */
static inline float *example_output_copy(const rp_tensor_list *list, size_t index,
                                         size_t *out_count) {
    DLManagedTensor *t = NULL;
    CHECK(rp_tensor_list_get(&t, list, index));
    const DLTensor *dl = &t->dl_tensor;
    float *copy = NULL;
    if (dl->device.device_type != kDLCPU || dl->dtype.code != kDLFloat || dl->dtype.bits != 32 ||
        dl->dtype.lanes != 1 || dl->ndim > 8) {
        fprintf(stderr, "unexpected output tensor (device %d, dtype code %d, %d bits, ndim %d)\n",
                (int)dl->device.device_type, (int)dl->dtype.code, (int)dl->dtype.bits,
                (int)dl->ndim);
        goto done;
    }
    size_t count = 1;
    for (int32_t d = 0; d < dl->ndim; ++d)
        count *= (size_t)dl->shape[d];
    copy = (float *)malloc((count ? count : 1) * sizeof(float));
    if (copy == NULL)
        goto done;
    const char *base = (const char *)dl->data + dl->byte_offset;
    for (size_t flat = 0; flat < count; ++flat) {
        /* Walk the logical index of element `flat` and apply the strides (or row-major). */
        size_t rest = flat;
        int64_t offset = 0, contiguous_stride = 1;
        for (int32_t d = dl->ndim - 1; d >= 0; --d) {
            int64_t i = (int64_t)(rest % (size_t)dl->shape[d]);
            rest /= (size_t)dl->shape[d];
            offset += i * (dl->strides ? dl->strides[d] : contiguous_stride);
            contiguous_stride *= dl->shape[d];
        }
        memcpy(&copy[flat], base + offset * (int64_t)sizeof(float), sizeof(float));
    }
    *out_count = count;
done:
    if (t->deleter)
        t->deleter(t);
    return copy;
}

/* A one-line progress display for loading and saving weights, on stderr: install it with
 * rp_set_progress_callback(example_show_progress, NULL). The library calls it on the thread that
 * loads or saves; on a terminal the line is rewritten in place, elsewhere (a log file) only the
 * completed operation is printed. */
static inline void example_show_progress(const char *what, int64_t done, int64_t total,
                                         void *user_data) {
    (void)user_data;
    if (done < total && !isatty(fileno(stderr)))
        return;
    const int percent = total > 0 ? (int)(100 * done / total) : 100;
    fprintf(stderr, "\r%s: %3d%% (%.1f of %.1f MB)", what, percent, (double)done / 1e6,
            (double)total / 1e6);
    if (done == total)
        fputc('\n', stderr);
    fflush(stderr);
}

/* A scratch folder for the weights file: $TMPDIR (or /tmp)/roundpipe-example-XXXXXX. */
static inline int example_make_temp_dir(char *buffer, size_t size) {
    const char *base = getenv("TMPDIR");
    if (base == NULL || base[0] == '\0')
        base = "/tmp";
    if (snprintf(buffer, size, "%s/roundpipe-example-XXXXXX", base) >= (int)size)
        return -1;
    return mkdtemp(buffer) ? 0 : -1;
}

/* Where an example saves its weights: `given` when the user named a path, else `file_name` in a
 * fresh scratch folder whose name goes to `temp_dir` (left "" otherwise, so the caller knows
 * whether to remove it). Returns 0, or -1 after printing why. */
static inline int example_output_path(char *path, size_t path_size, char *temp_dir,
                                      size_t temp_size, const char *given,
                                      const char *file_name) {
    temp_dir[0] = '\0';
    if (given != NULL) {
        snprintf(path, path_size, "%s", given);
        return 0;
    }
    if (example_make_temp_dir(temp_dir, temp_size) != 0) {
        perror("mkdtemp");
        return -1;
    }
    snprintf(path, path_size, "%s/%s", temp_dir, file_name);
    return 0;
}

#endif /* ROUNDPIPE_EXAMPLE_UTIL_H */
