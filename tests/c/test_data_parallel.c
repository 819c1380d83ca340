/*
 * test_data_parallel.c - data parallelism over c10d Gloo (rp_model_options_set_data_parallel).
 *
 * Two ranks, each a separate process (this executable started again in worker mode, so that no
 * process forks after libtorch has started its threads) with 2 CPU worker devices, each train on
 * their half of an 8-row batch; one process trains on the whole batch. Every microbatch is the
 * same 2 rows in both setups and each process's loss is its batch mean (MSE per microbatch
 * scaled by 1 / its microbatch count), so the average of the ranks' gradients is the single
 * process's gradient and the mean of their losses its loss: after 10 synchronous and then 10
 * asynchronous AdamW steps the losses and the weights of both ranks must match the single
 * process's to fp32 rounding (1e-5 relative: the two setups add the same terms in a different
 * order, ~6e-8 per addition, compounded over 20 AdamW steps). Both ranks must hold bit-identical
 * weights (they add the same two numbers). The ranks use different stage plans: the gradient
 * buckets follow the parameters, not the jobs, so the plan must not matter. The model has a
 * 27 MB weight, so the gradients travel in two buckets.
 *
 * With RP_TEST_DEVICE=cuda (scripts/gpu-check.sh, on a machine with 2 GPUs) each rank runs on
 * its own GPU (CUDA_VISIBLE_DEVICES) and the gradients are averaged on the GPUs with NCCL; there
 * every rank must run the same plan, so both use rank 0's.
 *
 * Also: inf or nan in one rank's gradients makes every rank skip that step (the gradients are
 * averaged, so the others' would carry it too; the skip decision must agree, or the ranks'
 * weights part); a rank that dies in the middle of a call makes the other rank's call fail with
 * RP_ERR_IO within the timeout, and every later call with RP_ERR_STATE; bad options are refused.
 */
#include "test_support.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define WIDE 2600
static const char *SPEC = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 6, \"out\": 2600},"
                          "{\"type\": \"tanh\"},"
                          "{\"type\": \"linear\", \"in\": 2600, \"out\": 2600},"
                          "{\"type\": \"tanh\"},"
                          "{\"type\": \"linear\", \"in\": 2600, \"out\": 3}]}";
static const int32_t PLAN_RANK0[2] = {2, 3};
static const int32_t PLAN_RANK1[3] = {1, 2, 2};
static const int32_t PLAN_SINGLE[2] = {3, 2};

#define ROWS 8
#define IN 6
#define OUT 3
#define SYNC_STEPS 10
#define ASYNC_STEPS 10
#define STEPS (SYNC_STEPS + ASYNC_STEPS)

static float X[ROWS * IN], Y[ROWS * OUT];
static const char *self_path = "/proc/self/exe";

static void fill_data(void) {
    ts_fill_uniform(X, ROWS * IN, 41, -1.5f, 1.5f);
    ts_fill_uniform(Y, ROWS * OUT, 42, -1.f, 1.f);
}

static char *joined(const char *a, const char *sep, const char *b) {
    char *p = malloc(strlen(a) + strlen(sep) + strlen(b) + 1);
    sprintf(p, "%s%s%s", a, sep, b);
    return p;
}

/* A port nobody listens on now (the kernel's choice); the worker binds it a moment later. */
static int free_port(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(s, (struct sockaddr *)&a, &len) != 0) {
        print_error("no free port\n");
        fail();
    }
    int port = ntohs(a.sin_port);
    close(s);
    return port;
}

static rp_model *dp_model_in(int rank, int port, const int32_t *plan, size_t plan_len,
                             int64_t timeout_ms, int32_t dtype, int32_t host_memory) {
    char rendezvous[64];
    snprintf(rendezvous, sizeof rendezvous, "tcp://127.0.0.1:%d", port);
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_OK(rp_model_options_set_seed(opts, 5 + (uint64_t)rank)); /* rank 0's weights must win */
    TS_OK(rp_model_options_set_devices(opts, ts_device_kind(), ts_devices(2)));
    TS_OK(rp_model_options_set_stage_plan(opts, plan, plan_len));
    TS_OK(rp_model_options_set_model_dtype(opts, dtype));
    TS_OK(rp_model_options_set_host_memory_mode(opts, host_memory));
    TS_OK(rp_model_options_set_data_parallel(opts, rank, 2, rendezvous, timeout_ms));
    TS_OK(rp_model_options_set_global_loss(opts, 1));
    rp_model *model = NULL;
    TS_OK(rp_model_create(&model, SPEC, opts));
    rp_model_options_destroy(opts);
    return model;
}

static rp_model *dp_model(int rank, int port, const int32_t *plan, size_t plan_len,
                          int64_t timeout_ms, int32_t dtype) {
    return dp_model_in(rank, port, plan, plan_len, timeout_ms, dtype, RP_HOST_MEMORY_STANDARD);
}

/* One training call on rows [r0, r0 + rows), 2 rows per microbatch, loss = batch mean. */
static rp_status fb_rows(double *out_loss, rp_model *model, int r0, int rows, rp_loss *loss) {
    int64_t xs[2] = {rows, IN}, ys[2] = {rows, OUT};
    DLManagedTensor *x = ts_f32(2, xs, X + r0 * IN), *y = ts_f32(2, ys, Y + r0 * OUT);
    rp_run_config *cfg = ts_config(rows / 2, 0);
    const DLManagedTensor *inputs[1] = {x};
    rp_status st = rp_forward_backward(out_loss, NULL, model, inputs, 1, y, loss, cfg);
    rp_run_config_destroy(cfg);
    ts_free(x);
    ts_free(y);
    return st;
}

static rp_loss *mean_mse(int microbatches) {
    rp_loss *loss = NULL;
    TS_OK(rp_loss_create(&loss, RP_LOSS_MSE));
    TS_OK(rp_loss_set_scale(loss, 1.0 / microbatches));
    return loss;
}

/* 10 synchronous, then 10 asynchronous AdamW steps on rows [r0, r0 + rows); losses[STEPS]. */
static void train(rp_model *model, int r0, int rows, double *losses) {
    rp_loss *loss = mean_mse(rows / 2);
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 3e-5));
    TS_OK(rp_optimizer_set_weight_decay(opt, 0.01));
    for (int s = 0; s < STEPS; ++s) {
        TS_OK(fb_rows(&losses[s], model, r0, rows, loss));
        TS_OK(rp_step(model, opt, s >= SYNC_STEPS));
    }
    TS_OK(rp_synchronize(model));
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
}

/* STEPS training calls that step inside (rp_model_set_step_in_call), AdamW as in train(). */
static void train_in_call(rp_model *model, int r0, int rows, double *losses) {
    rp_loss *loss = mean_mse(rows / 2);
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 3e-5));
    TS_OK(rp_optimizer_set_weight_decay(opt, 0.01));
    TS_OK(rp_model_set_step_in_call(model, opt));
    for (int s = 0; s < STEPS; ++s)
        TS_OK(fb_rows(&losses[s], model, r0, rows, loss));
    TS_OK(rp_synchronize(model));
    rp_optimizer_destroy(opt);
    rp_loss_destroy(loss);
}

/* ---- worker mode: test_data_parallel worker <mode> <rank> <port> <out file> ---------------- */

static void write_results(const char *path, const double *losses, const ts_params *w) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(losses, sizeof(double), STEPS, f) != STEPS)
        exit(3);
    for (size_t i = 0; i < w->count; ++i)
        if (fwrite(w->data[i], sizeof(float), (size_t)w->numel[i], f) != (size_t)w->numel[i])
            exit(3);
    fclose(f);
}

static int32_t die_in_the_loss(double *out_loss, DLManagedTensor **out_grad,
                               const DLManagedTensor *outputs, const DLManagedTensor *labels,
                               int32_t microbatch, void *user_data) {
    (void)out_loss, (void)out_grad, (void)outputs, (void)labels, (void)microbatch, (void)user_data;
    _exit(7); /* killed mid-call: the pipeline has started, its gradients never come */
}

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int worker(const char *mode, int rank, int port, const char *out) {
    fill_data();
    if (strcmp(mode, "train") == 0 || strcmp(mode, "train_bf16") == 0) {
        const int32_t dtype = strcmp(mode, "train_bf16") == 0 ? RP_DTYPE_BF16 : RP_DTYPE_DEFAULT;
        const int on_gpus = ts_device_kind() == RP_DEVICE_CUDA; /* NCCL: one plan for all */
        rp_model *model = rank == 0 || on_gpus ? dp_model(rank, port, PLAN_RANK0, 2, 60000, dtype)
                                               : dp_model(1, port, PLAN_RANK1, 3, 60000, dtype);
        int32_t r = -1, world = -1;
        TS_OK(rp_model_data_parallel(&r, &world, model));
        if (r != rank || world != 2)
            return 4;
        double losses[STEPS];
        train(model, rank * ROWS / 2, ROWS / 2, losses);
        ts_params *w = ts_masters(model);
        write_results(out, losses, w);
        ts_params_free(w);
        rp_model_destroy(model);
        return 0;
    }
    if (strcmp(mode, "in_call") == 0) {
        const int on_gpus = ts_device_kind() == RP_DEVICE_CUDA;
        rp_model *model =
            rank == 0 || on_gpus
                ? dp_model_in(rank, port, PLAN_RANK0, 2, 60000, RP_DTYPE_DEFAULT,
                              RP_HOST_MEMORY_SAVING)
                : dp_model_in(1, port, PLAN_RANK1, 3, 60000, RP_DTYPE_DEFAULT,
                              RP_HOST_MEMORY_SAVING);
        double losses[STEPS];
        train_in_call(model, rank * ROWS / 2, ROWS / 2, losses);
        ts_params *w = ts_masters(model);
        write_results(out, losses, w);
        ts_params_free(w);
        rp_model_destroy(model);
        return 0;
    }
    if (strcmp(mode, "nan") == 0) {
        /* Rank 1's first call has a nan label; both ranks must skip that step and not the next. */
        rp_model *model = dp_model(rank, port, PLAN_RANK0, 2, 60000, RP_DTYPE_DEFAULT);
        rp_loss *loss = mean_mse(2);
        rp_optimizer *opt = NULL;
        TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
        double l = 0.0;
        const float saved = Y[4 * OUT];
        if (rank == 1)
            Y[4 * OUT] = NAN; /* row 4: rank 1's first row */
        TS_OK(fb_rows(&l, model, rank * 4, 4, loss));
        TS_OK(rp_step(model, opt, 0));
        TS_OK(rp_synchronize(model));
        Y[4 * OUT] = saved;
        int64_t skipped_first = -1, skipped_second = -1;
        double scale = 0;
        TS_OK(rp_model_grad_scale(&scale, &skipped_first, model));
        ts_params *after_first = ts_masters(model);
        TS_OK(fb_rows(&l, model, rank * 4, 4, loss));
        TS_OK(rp_step(model, opt, 0));
        TS_OK(rp_synchronize(model));
        TS_OK(rp_model_grad_scale(&scale, &skipped_second, model));
        ts_params *after_second = ts_masters(model);
        /* the first step changed nothing (checked against the seed-5 weights by the test), the
         * second changed the weights */
        int changed = 0;
        for (size_t i = 0; i < after_first->count; ++i)
            changed |= memcmp(after_first->data[i], after_second->data[i],
                              sizeof(float) * (size_t)after_first->numel[i]) != 0;
        FILE *f = fopen(out, "w");
        fprintf(f, "%lld %lld %d\n", (long long)skipped_first, (long long)skipped_second, changed);
        fclose(f);
        char *weights = joined(out, "", ".bin");
        double zeros[STEPS] = {0};
        write_results(weights, zeros, after_first);
        free(weights);
        ts_params_free(after_first);
        ts_params_free(after_second);
        rp_optimizer_destroy(opt);
        rp_loss_destroy(loss);
        rp_model_destroy(model);
        return 0;
    }
    if (strcmp(mode, "die") == 0) {
        const int64_t timeout_ms = 5000;
        rp_model *model = dp_model(rank, port, PLAN_RANK0, 2, timeout_ms, RP_DTYPE_DEFAULT);
        rp_loss *loss = NULL;
        if (rank == 1)
            TS_OK(rp_loss_create_callback(&loss, die_in_the_loss, NULL));
        else
            loss = mean_mse(2);
        double l = 0.0, t0 = seconds_now();
        rp_status first = fb_rows(&l, model, 0, 4, loss);
        double elapsed = seconds_now() - t0;
        char message[512];
        snprintf(message, sizeof message, "%s", rp_last_error_message());
        rp_status second = fb_rows(&l, model, 0, 4, loss);
        FILE *f = fopen(out, "w");
        fprintf(f, "%d %d %.3f %s\n", (int)first, (int)second, elapsed, message);
        fclose(f);
        rp_loss_destroy(loss);
        rp_model_destroy(model);
        return 0;
    }
    return 2;
}

/* ---- the tests ----------------------------------------------------------------------------- */

static pid_t spawn_worker(const char *mode, int rank, int port, const char *out) {
    char rank_s[16], port_s[16];
    snprintf(rank_s, sizeof rank_s, "%d", rank);
    snprintf(port_s, sizeof port_s, "%d", port);
    char *argv[] = {(char *)self_path, "worker", (char *)mode, rank_s, port_s, (char *)out, NULL};
    /* On GPUs each rank has its own: the first visible GPU is the rank's. */
    char visible[48];
    snprintf(visible, sizeof visible, "CUDA_VISIBLE_DEVICES=%d", rank);
    size_t n = 0;
    while (environ[n])
        ++n;
    char **env = calloc(n + 2, sizeof(char *));
    size_t k = 0;
    for (size_t i = 0; i < n; ++i)
        if (strncmp(environ[i], "CUDA_VISIBLE_DEVICES=", 21) != 0)
            env[k++] = environ[i];
    if (ts_device_kind() == RP_DEVICE_CUDA)
        env[k++] = visible;
    pid_t pid = 0;
    const int spawned = posix_spawn(&pid, self_path, NULL, NULL, argv, env);
    free(env);
    if (spawned != 0) {
        print_error("could not start a worker\n");
        fail();
    }
    return pid;
}

/* Waits at most `seconds` for the worker; kills it after that. Returns its exit status. */
static int wait_worker(pid_t pid, double seconds) {
    const double end = seconds_now() + seconds;
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
        if (seconds_now() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            print_error("worker %d did not finish within %.0f s\n", (int)pid, seconds);
            return -1;
        }
        usleep(20000);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Both ranks of worker mode `mode`, rank r writing <dir>/rank<r>; each waited for at most
 * `seconds`. */
typedef struct {
    char *dir;
    char *out[2];
    int status[2];
} two_ranks;

static two_ranks run_two_ranks(const char *mode, double seconds) {
    two_ranks t;
    t.dir = ts_tempdir();
    t.out[0] = joined(t.dir, "/", "rank0");
    t.out[1] = joined(t.dir, "/", "rank1");
    const int port = free_port();
    pid_t pid[2];
    for (int r = 0; r < 2; ++r)
        pid[r] = spawn_worker(mode, r, port, t.out[r]);
    for (int r = 0; r < 2; ++r)
        t.status[r] = wait_worker(pid[r], seconds);
    return t;
}

static void two_ranks_free(two_ranks *t) {
    ts_rmdir(t->dir);
    free(t->out[0]);
    free(t->out[1]);
    free(t->dir);
}

static void read_results(const char *path, double *losses, ts_params *like) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fread(losses, sizeof(double), STEPS, f), STEPS);
    for (size_t i = 0; i < like->count; ++i)
        assert_int_equal(fread(like->data[i], sizeof(float), (size_t)like->numel[i], f),
                         (size_t)like->numel[i]);
    fclose(f);
}

static void two_ranks_on_half_batches_train_like_one_process_on_the_whole_batch(void **state) {
    (void)state;
    two_ranks run = run_two_ranks("train", 240);
    assert_int_equal(run.status[0], 0);
    assert_int_equal(run.status[1], 0);

    /* The single process: same weights as rank 0 (seed 5), the whole batch. */
    rp_model *single = ts_model(SPEC, 5, 2, PLAN_SINGLE, 2);
    double want[STEPS];
    train(single, 0, ROWS, want);
    ts_params *w_single = ts_masters(single);
    ts_params *w0 = ts_masters(single), *w1 = ts_masters(single); /* shapes; overwritten */
    double got0[STEPS], got1[STEPS];
    read_results(run.out[0], got0, w0);
    read_results(run.out[1], got1, w1);
    for (int s = 0; s < STEPS; ++s) {
        if (!(fabs(got0[s] - want[s]) <= 1e-5 * fabs(want[s])) || got1[s] != got0[s]) {
            print_error("step %d: global losses %.10g (rank 0) and %.10g (rank 1), one process "
                        "on the whole batch %.10g\n", s, got0[s], got1[s], want[s]);
            fail();
        }
    }
    if (!(want[STEPS - 1] < 0.5 * want[0])) { /* it trains */
        for (int s = 0; s < STEPS; ++s)
            print_error("loss %d: %.6g\n", s, want[s]);
        fail();
    }
    ts_assert_params_equal(w0, w1);
    ts_assert_params_close(w0, w_single, 1e-5, "rank 0 weights vs one process");
    ts_params_free(w_single);
    ts_params_free(w0);
    ts_params_free(w1);
    rp_model_destroy(single);
    two_ranks_free(&run);
}

/* The single-process side of a comparison: seed 5 (rank 0's weights), the whole batch. */
static rp_model *single_model(int32_t dtype, int32_t host_memory) {
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_OK(rp_model_options_set_seed(opts, 5));
    TS_OK(rp_model_options_set_devices(opts, ts_device_kind(), ts_devices(2)));
    TS_OK(rp_model_options_set_stage_plan(opts, PLAN_SINGLE, 2));
    TS_OK(rp_model_options_set_model_dtype(opts, dtype));
    TS_OK(rp_model_options_set_host_memory_mode(opts, host_memory));
    rp_model *model = NULL;
    TS_OK(rp_model_create(&model, SPEC, opts));
    rp_model_options_destroy(opts);
    return model;
}

/* Steps inside the calls (memory-saving mode, fp32): each rank updates every parameter from its
 * average as soon as that is final, so the ranks must end exactly where the explicit steps of
 * the test above take them: like one process on the whole batch with in-call steps, to the same
 * 1e-5 (the averages differ from the whole batch's gradients in fp32 rounding; the bf16 moments'
 * stochastic rounding uses the same random bits on both sides, so a differing decision needs a
 * moment within that rounding of its threshold, rare, and moves one element by one bf16 ulp of
 * an lr-sized update), and bit-identical to each other. Rank 1 runs a different stage plan. */
static void two_ranks_stepping_inside_their_calls_train_like_one_process(void **state) {
    (void)state;
    two_ranks run = run_two_ranks("in_call", 240);
    assert_int_equal(run.status[0], 0);
    assert_int_equal(run.status[1], 0);
    rp_model *single = single_model(RP_DTYPE_DEFAULT, RP_HOST_MEMORY_SAVING);
    ts_params *init = ts_masters(single);
    double want[STEPS];
    train_in_call(single, 0, ROWS, want);
    ts_params *w_single = ts_masters(single);
    ts_params *w0 = ts_masters(single), *w1 = ts_masters(single); /* shapes; overwritten */
    double got0[STEPS], got1[STEPS];
    read_results(run.out[0], got0, w0);
    read_results(run.out[1], got1, w1);
    for (int s = 0; s < STEPS; ++s)
        if (!(fabs(got0[s] - want[s]) <= 1e-5 * fabs(want[s])) || got1[s] != got0[s]) {
            print_error("in-call step %d: global losses %.10g (rank 0) and %.10g (rank 1), one "
                        "process %.10g\n", s, got0[s], got1[s], want[s]);
            fail();
        }
    assert_true(want[STEPS - 1] < 0.5 * want[0]); /* it trains */
    ts_assert_params_equal(w0, w1);
    ts_assert_params_close(w0, w_single, 1e-5, "rank 0 weights (in-call steps) vs one process");
    /* ... and the comparison can fail: the steps moved every weight tensor 10x farther. */
    for (size_t i = 0; i < init->count; ++i) /* measured: 1e-3 to 2e-2 */
        assert_true(ts_rel_err(w_single->data[i], init->data[i], init->numel[i], 1e-6) > 1e-4);
    ts_params_free(init);
    ts_params_free(w_single);
    ts_params_free(w0);
    ts_params_free(w1);
    rp_model_destroy(single);
    two_ranks_free(&run);
}

/* Norm-based relative error of the weight updates (w - w_init) of a against b. */
static double update_error(const ts_params *a, const ts_params *b, const ts_params *init) {
    double num = 0, den = 0;
    for (size_t i = 0; i < init->count; ++i)
        for (int64_t k = 0; k < init->numel[i]; ++k) {
            const double da = (double)a->data[i][k] - init->data[i][k];
            const double db = (double)b->data[i][k] - init->data[i][k];
            num += (da - db) * (da - db);
            den += db * db;
        }
    return sqrt(num / den);
}

/* bf16 models: the ranks compute in bf16 and, on GPUs, NCCL averages their bf16 gradients (on
 * CPU devices Gloo averages fp32 ones). The single process rounds differently (its microbatches'
 * bf16 gradients are summed in fp32 on the host), so equality holds within bf16 rounding: each
 * gradient element carries up to 2^-8 relative error from one more rounding, which Adam's
 * normalised update passes on; over 20 steps the weight updates (w - w_init, fp32 masters) must
 * agree to 3e-2 (norm-based; measured on two H200s: see the note of the session that added it),
 * the losses to 1e-2. The tolerance is shown to be meaningful: a process that trains on rank 0's
 * half alone (no averaging) is far outside it. The ranks stay bit-identical. */
static void bf16_two_ranks_update_the_weights_like_one_process_within_bf16_rounding(void **state) {
    (void)state;
    two_ranks run = run_two_ranks("train_bf16", 240);
    assert_int_equal(run.status[0], 0);
    assert_int_equal(run.status[1], 0);
    rp_model *single = single_model(RP_DTYPE_BF16, RP_HOST_MEMORY_STANDARD);
    rp_model *half = single_model(RP_DTYPE_BF16, RP_HOST_MEMORY_STANDARD);
    ts_params *init = ts_masters(single);
    double want[STEPS], half_losses[STEPS];
    train(single, 0, ROWS, want);
    train(half, 0, ROWS / 2, half_losses);
    ts_params *w_single = ts_masters(single), *w_half = ts_masters(half);
    ts_params *w0 = ts_masters(single), *w1 = ts_masters(single); /* shapes; overwritten */
    double got0[STEPS], got1[STEPS];
    read_results(run.out[0], got0, w0);
    read_results(run.out[1], got1, w1);
    for (int s = 0; s < STEPS; ++s)
        if (!(fabs(got0[s] - want[s]) <= 1e-2 * fabs(want[s])) || got1[s] != got0[s]) {
            print_error("bf16 step %d: global losses %.10g (rank 0) and %.10g (rank 1), one "
                        "process %.10g\n", s, got0[s], got1[s], want[s]);
            fail();
        }
    ts_assert_params_equal(w0, w1);
    const double err = update_error(w0, w_single, init);
    const double unaveraged = update_error(w_half, w_single, init);
    print_message("bf16 weight updates: ranks vs one process %.3g; half batch alone %.3g\n", err,
                  unaveraged);
    assert_true(err <= 3e-2);
    assert_true(unaveraged > 10 * 3e-2);
    ts_params_free(init);
    ts_params_free(w_single);
    ts_params_free(w_half);
    ts_params_free(w0);
    ts_params_free(w1);
    rp_model_destroy(single);
    rp_model_destroy(half);
    two_ranks_free(&run);
}

static void nonfinite_gradients_on_one_rank_make_every_rank_skip_the_step(void **state) {
    (void)state;
    two_ranks run = run_two_ranks("nan", 240);
    assert_int_equal(run.status[0], 0);
    assert_int_equal(run.status[1], 0);
    rp_model *initial = ts_model(SPEC, 5, 2, PLAN_RANK0, 2); /* rank 0's seed: the weights */
    ts_params *w_initial = ts_masters(initial);
    for (int r = 0; r < 2; ++r) {
        FILE *f = fopen(run.out[r], "r");
        assert_non_null(f);
        long long first = -1, second = -1;
        int changed = -1;
        assert_int_equal(fscanf(f, "%lld %lld %d", &first, &second, &changed), 3);
        fclose(f);
        if (first != 1 || second != 1 || changed != 1) {
            print_error("rank %d: skipped %lld after the nan step, %lld after the next; the next "
                        "step %s the weights\n", r, first, second, changed ? "changed" : "kept");
            fail();
        }
        char *weights = joined(run.out[r], "", ".bin");
        ts_params *w = ts_masters(initial); /* shapes; overwritten */
        double zeros[STEPS];
        read_results(weights, zeros, w);
        ts_assert_params_equal(w, w_initial); /* the skipped step left rank 0's weights */
        ts_params_free(w);
        free(weights);
    }
    ts_params_free(w_initial);
    rp_model_destroy(initial);
    two_ranks_free(&run);
}

static void a_rank_dying_mid_call_fails_the_other_ranks_call_within_the_timeout(void **state) {
    (void)state;
    two_ranks run = run_two_ranks("die", 120);
    assert_int_equal(run.status[1], 7); /* died in its loss callback */
    assert_int_equal(run.status[0], 0);
    FILE *f = fopen(run.out[0], "r");
    assert_non_null(f);
    int first = 0, second = 0;
    double elapsed = 0;
    char message[512] = "";
    assert_int_equal(fscanf(f, "%d %d %lf %511[^\n]", &first, &second, &elapsed, message), 4);
    fclose(f);
    if (first != RP_ERR_IO || second != RP_ERR_STATE || elapsed > 5.0 + 10.0 ||
        !ts_contains(message, "data parallelism")) {
        print_error("first call %d after %.2f s (%s), second call %d\n", first, elapsed, message,
                    second);
        fail();
    }
    two_ranks_free(&run);
}

static void bad_data_parallel_options_are_refused(void **state) {
    (void)state;
    rp_model_options *opts = NULL;
    TS_OK(rp_model_options_create(&opts));
    TS_ERR(rp_model_options_set_data_parallel(opts, 2, 2, NULL, 0), RP_ERR_INVALID_ARGUMENT, "rank");
    TS_ERR(rp_model_options_set_data_parallel(opts, 0, -2, NULL, 0), RP_ERR_INVALID_ARGUMENT,
           "world_size");
    TS_ERR(rp_model_options_set_data_parallel(opts, 0, 2, NULL, -1), RP_ERR_INVALID_ARGUMENT,
           "timeout");
    TS_ERR(rp_model_options_set_global_loss(opts, 2), RP_ERR_INVALID_ARGUMENT, "0 or 1");
    /* Checked at creation, before anything is built: the address and the environment. */
    TS_OK(rp_model_options_set_data_parallel(opts, 0, 2, "udp://x:1", 1000));
    rp_model *model = NULL;
    TS_ERR(rp_model_create(&model, SPEC, opts), RP_ERR_INVALID_ARGUMENT, "env://");
    assert_null(model);
    TS_OK(rp_model_options_set_data_parallel(opts, 0, 2, "tcp://127.0.0.1:99999", 1000));
    TS_ERR(rp_model_create(&model, SPEC, opts), RP_ERR_INVALID_ARGUMENT, "65535");
    unsetenv("MASTER_ADDR");
    TS_OK(rp_model_options_set_data_parallel(opts, 0, 2, "env://", 1000));
    TS_ERR(rp_model_create(&model, SPEC, opts), RP_ERR_INVALID_ARGUMENT, "MASTER_ADDR");
    rp_model_options_destroy(opts);
    /* Without data parallelism a model is rank 0 of 1. */
    rp_model *plain = ts_model(SPEC, 5, 1, NULL, 0);
    int32_t rank = -1, world = -1;
    TS_OK(rp_model_data_parallel(&rank, &world, plain));
    assert_int_equal(rank, 0);
    assert_int_equal(world, 1);
    int32_t available = -1;
    TS_OK(rp_data_parallel_available(&available));
    assert_int_equal(available, 1);
    rp_model_destroy(plain);
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "worker") == 0)
        return worker(argv[2], atoi(argv[3]), atoi(argv[4]), argv[5]);
    fill_data();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bad_data_parallel_options_are_refused),
        cmocka_unit_test(two_ranks_on_half_batches_train_like_one_process_on_the_whole_batch),
        cmocka_unit_test(bf16_two_ranks_update_the_weights_like_one_process_within_bf16_rounding),
        cmocka_unit_test(two_ranks_stepping_inside_their_calls_train_like_one_process),
        cmocka_unit_test(nonfinite_gradients_on_one_rank_make_every_rank_skip_the_step),
        cmocka_unit_test(a_rank_dying_mid_call_fails_the_other_ranks_call_within_the_timeout),
    };
    return cmocka_run_group_tests_name("data_parallel", tests, NULL, NULL);
}
