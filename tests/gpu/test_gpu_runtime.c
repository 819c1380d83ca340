/*
 * test_gpu_runtime.c - the GPU streaming runtime on a real GPU: a model four times larger than
 * the GPU memory cap trains while the allocator's measured peak stays under the cap; an
 * out-of-memory stage is reported with advice and leaves the model usable; the timing record
 * holds every stream; the LM head's loss chunks follow a small cap; weights uploaded for the next
 * call during the last one's last job give the results of a CPU device. Skips (exit 77) without a visible GPU.
 *
 * RP_TRACE_OUT=<file>: also writes the large model's last timing record there (Chrome trace).
 */
#include "test_support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* 32 residual blocks of 2048 -> 4096 -> 2048: 67 MB of fp32 weights each, 2.1 GB in all, so the
 * 32 MiB cuBLAS workspace of a stream is small next to the cap. */
enum { BLOCKS = 32, DIM = 2048, HIDDEN = 4096, ROWS = 64 };
static const int64_t BLOCK_PARAMS = 2LL * DIM + 2LL * DIM * HIDDEN + HIDDEN + DIM;

/* `blocks` residual_mlp blocks of dim -> hidden -> dim (the caller frees the text). */
static char *mlp_spec(int blocks, int dim, int hidden) {
    size_t cap = 64 + (size_t)blocks * 96;
    char *spec = malloc(cap);
    strcpy(spec, "{\"layers\":[");
    for (int i = 0; i < blocks; ++i) {
        char entry[96];
        snprintf(entry, sizeof entry, "%s{\"type\":\"residual_mlp\",\"dim\":%d,\"hidden\":%d}",
                 i ? "," : "", dim, hidden);
        strcat(spec, entry);
    }
    strcat(spec, "]}");
    return spec;
}

static char *big_spec(void) { return mlp_spec(BLOCKS, DIM, HIDDEN); }

/* One device of `kind`; a cap of 0 is the default; `plan` (plan_len stages) may be NULL. */
static rp_model *model_with(const char *spec, int32_t kind, int64_t cap, uint64_t seed,
                            const int32_t *plan, size_t plan_len) {
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, kind, 1));
    TS_OK(rp_model_options_set_gpu_memory_cap(o, cap));
    TS_OK(rp_model_options_set_seed(o, seed));
    if (plan)
        TS_OK(rp_model_options_set_stage_plan(o, plan, plan_len));
    rp_model *m = NULL;
    TS_OK(rp_model_create(&m, spec, o));
    rp_model_options_destroy(o);
    return m;
}

static rp_model *make_model(const char *spec, int32_t kind, int64_t cap) {
    return model_with(spec, kind, cap, 7, NULL, 0);
}

static rp_model *gpu_model(const char *spec, int64_t cap) {
    return make_model(spec, RP_DEVICE_CUDA, cap);
}

enum { STEPS = 4 };

/* Trains STEPS async SGD steps; writes each step's loss. */
static void train(rp_model *m, double *losses) {
    int64_t xs[2] = {ROWS, DIM};
    float *x = malloc(sizeof(float) * ROWS * DIM), *y = malloc(sizeof(float) * ROWS * DIM);
    ts_fill_uniform(x, ROWS * DIM, 1, -1, 1);
    ts_fill_uniform(y, ROWS * DIM, 2, -1, 1);
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, xs, y);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
    TS_OK(rp_optimizer_set_learning_rate(opt, 1e-2));
    for (int step = 0; step < STEPS; ++step) {
        TS_OK(rp_forward_backward(&losses[step], NULL, m, inputs, 1, lab, mse, NULL));
        TS_OK(rp_step(m, opt, 1));
    }
    TS_OK(rp_synchronize(m));
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    ts_free(in);
    ts_free(lab);
    free(x);
    free(y);
}

static void model_four_times_the_cap_trains_under_the_cap(void **state) {
    (void)state;
    const int64_t weight_bytes = BLOCKS * BLOCK_PARAMS * 4;
    const int64_t cap = weight_bytes / 4;
    char *spec = big_spec();
    rp_model *m = gpu_model(spec, cap);
    int32_t stages = 0;
    TS_OK(rp_model_num_stages(&stages, m));
    TS_OK(rp_cuda_reset_peak_memory(0));
    double gpu[STEPS], cpu[STEPS];
    train(m, gpu);
    int64_t now = 0, peak = 0;
    TS_OK(rp_cuda_memory_stats(&now, &peak, 0));

    const char *trace = NULL;
    TS_OK(rp_model_trace_json(&trace, m));
    const char *out = getenv("RP_TRACE_OUT");
    if (out) {
        FILE *f = fopen(out, "w");
        assert_non_null(f);
        fputs(trace, f);
        fclose(f);
    }
    assert_non_null(strstr(trace, "\"tid\":\"compute\""));
    assert_non_null(strstr(trace, "\"tid\":\"weights\""));
    assert_non_null(strstr(trace, "\"tid\":\"download\""));
    assert_non_null(strstr(trace, "\"enqueued_us\"")); /* GPU events say when they were enqueued */
    rp_model_destroy(m);

    /* The same model and data on a CPU device: the engine there matches the plain libtorch
     * reference (tests/c), so this checks the streamed GPU run end to end at scale. fp32 with
     * TF32 off; the tolerance covers summation order over 32 blocks of 4096-wide products. */
    rp_model *c = make_model(spec, RP_DEVICE_CPU, 0);
    train(c, cpu);
    rp_model_destroy(c);
    printf("weights %.1f MiB, cap %.1f MiB, %d stages, peak allocated %.1f MiB\n",
           weight_bytes / 1048576.0, cap / 1048576.0, stages, peak / 1048576.0);
    for (int i = 0; i < STEPS; ++i)
        printf("step %d loss gpu %.6f cpu %.6f\n", i, gpu[i], cpu[i]);
    assert_true(stages >= 4);
    assert_true(peak < cap);
    for (int i = 0; i < STEPS; ++i)
        assert_true(fabs(gpu[i] - cpu[i]) <= 1e-3 * fabs(cpu[i]));
    assert_true(gpu[STEPS - 1] < gpu[0]);
    free(spec);
}

static void out_of_memory_names_the_stage_and_the_model_stays_usable(void **state) {
    (void)state;
    /* 8 MB of layer footprint under a 256 MB cap (room for cuBLAS workspaces), but a 1 GiB
     * activation in the single microbatch. */
    rp_model *m = gpu_model("{\"layers\":[{\"type\":\"linear\",\"in\":1024,\"out\":1024},"
                            "{\"type\":\"relu\"},{\"type\":\"linear\",\"in\":1024,\"out\":1}]}",
                            256LL << 20);
    rp_run_config *one = NULL;
    TS_OK(rp_run_config_create(&one));
    TS_OK(rp_run_config_set_num_microbatch(one, 1));
    enum { BIG = 262144 };
    int64_t xs[2] = {BIG, 1024}, ys[2] = {BIG, 1};
    DLManagedTensor *x = ts_f32(2, xs, NULL), *y = ts_f32(2, ys, NULL);
    const DLManagedTensor *inputs[1] = {x};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    double loss = 0;
    TS_ERR(rp_forward_backward(&loss, NULL, m, inputs, 1, y, mse, one), RP_ERR_OUT_OF_MEMORY,
           "stage", "microbatch");
    printf("out-of-memory message: %s\n", rp_last_error_message());

    /* Usable afterwards: a batch that fits trains, and its gradient is finite and non-zero. */
    int64_t small_x[2] = {64, 1024}, small_y[2] = {64, 1};
    float *xv = malloc(sizeof(float) * 64 * 1024), yv[64];
    ts_fill_uniform(xv, 64 * 1024, 3, -1, 1);
    ts_fill_uniform(yv, 64, 4, -1, 1);
    DLManagedTensor *sx = ts_f32(2, small_x, xv), *sy = ts_f32(2, small_y, yv);
    const DLManagedTensor *small[1] = {sx};
    TS_OK(rp_forward_backward(&loss, NULL, m, small, 1, sy, mse, NULL));
    assert_true(loss > 0 && loss < 1e6);
    ts_free(sx);
    ts_free(sy);
    free(xv);
    ts_free(x);
    ts_free(y);
    rp_loss_destroy(mse);
    rp_run_config_destroy(one);
    rp_model_destroy(m);
}

/* The fused LM-head loss sizes its chunks from the memory cap: 8192 tokens over a vocabulary of
 * 50,021 (odd: rows of logits start off 16-byte boundaries) have 1.6 GB of fp32 logits, and
 * the longest chunk (4096 tokens, 820 MB) alone exceeds a 384 MiB cap. Under that cap the head
 * gets a 67 MB workspace (half a stage's third of the cap), 26 MB of it the fp32 gradient
 * accumulator, so its chunks are 128 tokens (26 MB of logits); the calls train within the cap
 * (which the allocator enforces) and give the losses of a CPU run, whose chunks (no cap there)
 * hold 128 MiB of logits, 640 tokens. */
static void lm_head_loss_chunks_follow_a_small_cap(void **state) {
    (void)state;
    enum { VOCAB = 50021, SEQS = 2, SEQ = 4096, LM_STEPS = 3 };
    static const char *SPEC = "{\"layers\":[{\"type\":\"token_embedding\",\"num\":50021,"
                              "\"dim\":128},{\"type\":\"lm_head\",\"dim\":128,"
                              "\"vocab\":50021,\"tied_to\":\"0.weight\"}]}";
    const int64_t cap = 384LL << 20;
    int64_t shape[2] = {SEQS, SEQ};
    int64_t *ids = malloc(sizeof(int64_t) * SEQS * SEQ);
    uint64_t x = 88172645463325252ULL;
    for (int64_t i = 0; i < SEQS * SEQ; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ids[i] = (int64_t)(x % VOCAB);
    }
    DLManagedTensor *in = ts_i64(2, shape, ids), *lab = ts_i64(2, shape, ids);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *lm = NULL;
    TS_OK(rp_loss_create(&lm, RP_LOSS_CAUSAL_LM));
    rp_run_config *one = NULL;
    TS_OK(rp_run_config_create(&one));
    TS_OK(rp_run_config_set_num_microbatch(one, 1));
    double losses[2][LM_STEPS];
    int64_t peak = 0;
    for (int run = 0; run < 2; ++run) {
        rp_model *m = run == 0 ? gpu_model(SPEC, cap) : make_model(SPEC, RP_DEVICE_CPU, 0);
        rp_optimizer *opt = NULL;
        TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_SGD));
        /* Embeddings of std 0.02 get tiny gradients from a mean over 8192 tokens: this rate
         * moves the loss by a few percent per step (10.82, 10.76, 10.53 in PyTorch), so the
         * later steps compare the gradients of both runs. */
        TS_OK(rp_optimizer_set_learning_rate(opt, 5000.0));
        if (run == 0)
            TS_OK(rp_cuda_reset_peak_memory(0));
        for (int step = 0; step < LM_STEPS; ++step) {
            TS_OK(rp_forward_backward(&losses[run][step], NULL, m, inputs, 1, lab, lm, one));
            TS_OK(rp_step(m, opt, 0));
        }
        TS_OK(rp_synchronize(m));
        if (run == 0) {
            int64_t now = 0;
            TS_OK(rp_cuda_memory_stats(&now, &peak, 0));
        }
        rp_optimizer_destroy(opt);
        rp_model_destroy(m);
    }
    printf("lm head: cap %.0f MiB, full logits %.0f MiB, peak allocated %.1f MiB\n",
           cap / 1048576.0, (double)SEQS * SEQ * VOCAB * 4 / 1048576.0, peak / 1048576.0);
    for (int i = 0; i < LM_STEPS; ++i)
        printf("step %d loss gpu %.6f cpu %.6f\n", i, losses[0][i], losses[1][i]);
    assert_true(peak > 0 && peak < cap);
    /* fp32 on both (TF32 off): only the order of the sums over 8192 tokens, 50,021 logits and
     * 128 dimensions differs. */
    for (int i = 0; i < LM_STEPS; ++i)
        assert_true(fabs(losses[0][i] - losses[1][i]) <= 1e-4 * fabs(losses[1][i]));
    assert_true(losses[0][LM_STEPS - 1] < losses[0][0]);
    rp_run_config_destroy(one);
    rp_loss_destroy(lm);
    ts_free(in);
    ts_free(lab);
    free(ids);
}

/* The weights of a call's first job, uploaded during the previous call's last job
 * (src/engine/carried_weights.h), against the same calls on a CPU device, where nothing is
 * carried: fp32, TF32 off, AdamW at a learning rate (1e-2) at which weights one step stale are
 * off by about 1e-2 (20% of these weights) and move a loss by a percent or more, against
 * tolerances of 1e-4 on the losses (seen: 1e-5) and 1e-3 on the weights (seen: 1.5e-4 after
 * nine AdamW steps, whose normalised updates carry GPU-versus-CPU summation order through).
 * Async steps with a pause after each (the step is done before the next call, so its weights go
 * up early), then the sequences in which an early upload must not be used: two calls for one step, rp_synchronize (which republishes the weights), a
 * master written by the caller, a forward call between training calls. On one GPU the next
 * call's first two jobs are stages 0 and 1: a call that took the early uploads has no upload
 * of its own for "forward stage 0" or "forward stage 1", and the call before it shows "next
 * call's forward stage 0" (or this call shows it "uploaded by the last call"). */
enum { SMALL_BLOCKS = 6, SMALL_DIM = 256, SMALL_ROWS = 32, CALLS = 10 };

static rp_model *planned_model(int32_t kind) {
    char *spec = mlp_spec(SMALL_BLOCKS, SMALL_DIM, 2 * SMALL_DIM);
    const int32_t plan[3] = {2, 2, 2};
    rp_model *m = model_with(spec, kind, 0, 11, plan, 3);
    free(spec);
    return m;
}

static void pause_for_the_step(void) {
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

static int has(const char *trace, const char *needle) { return strstr(trace, needle) != NULL; }

/* Runs the sequence; per training call its loss and, on a GPU, whether its trace shows an
 * upload of stage 0 for the next call (`carried`: by this call, or by the call before when
 * still in flight as that call ended, which this call's trace reports) and whether it uploaded
 * stage 0 itself (`own`). */
static void run_sequence(rp_model *m, double *losses, int *carried, int *own, int *own1) {
    int64_t xs[2] = {SMALL_ROWS, SMALL_DIM};
    float x[SMALL_ROWS * SMALL_DIM], y[SMALL_ROWS * SMALL_DIM];
    ts_fill_uniform(x, SMALL_ROWS * SMALL_DIM, 3, -1, 1);
    ts_fill_uniform(y, SMALL_ROWS * SMALL_DIM, 4, -1, 1);
    DLManagedTensor *in = ts_f32(2, xs, x), *lab = ts_f32(2, xs, y);
    const DLManagedTensor *inputs[1] = {in};
    rp_loss *mse = NULL;
    TS_OK(rp_loss_create(&mse, RP_LOSS_MSE));
    rp_optimizer *opt = NULL;
    TS_OK(rp_optimizer_create(&opt, RP_OPTIMIZER_ADAMW));
    TS_OK(rp_optimizer_set_learning_rate(opt, 1e-2));
    for (int call = 0; call < CALLS; ++call) {
        TS_OK(rp_forward_backward(&losses[call], NULL, m, inputs, 1, lab, mse, NULL));
        const char *trace = NULL;
        TS_OK(rp_model_trace_json(&trace, m));
        carried[call] = has(trace, "\"name\":\"next call's forward stage 0\"");
        if (call > 0 && has(trace, "\"name\":\"forward stage 0 (uploaded by the last call)\""))
            carried[call - 1] = 1;
        own[call] = has(trace, "\"name\":\"forward stage 0\",\"ph\":\"X\",\"pid\":0,"
                               "\"tid\":\"weights\"");
        own1[call] = has(trace, "\"name\":\"forward stage 1\",\"ph\":\"X\",\"pid\":0,"
                                "\"tid\":\"weights\"");
        if (call == 4)
            continue; /* calls 4 and 5 accumulate for one step */
        TS_OK(rp_step(m, opt, 1));
        pause_for_the_step();
        if (call == 6)
            TS_OK(rp_synchronize(m)); /* republishes: an upload from call 6 is stale */
        if (call == 7) {
            float v[SMALL_DIM];
            for (int i = 0; i < SMALL_DIM; ++i)
                v[i] = 0.75f;
            assert_int_equal(ts_param_numel(m, 0), SMALL_DIM);
            ts_set_master(m, 0, v, SMALL_DIM); /* the caller's write, published */
        }
        if (call == 8) {
            rp_tensor_list *outs = NULL;
            TS_OK(rp_forward(&outs, m, inputs, 1, NULL));
            rp_tensor_list_destroy(outs);
        }
    }
    TS_OK(rp_synchronize(m));
    rp_optimizer_destroy(opt);
    rp_loss_destroy(mse);
    ts_free(in);
    ts_free(lab);
}

static void early_uploads_for_the_next_call_give_the_cpu_results(void **state) {
    (void)state;
    double gpu[CALLS], cpu[CALLS];
    int carried[CALLS], own[CALLS], own1[CALLS], unused[CALLS];
    rp_model *g = planned_model(RP_DEVICE_CUDA);
    run_sequence(g, gpu, carried, own, own1);
    ts_params *gw = ts_masters(g);
    rp_model_destroy(g);
    rp_model *c = planned_model(RP_DEVICE_CPU);
    run_sequence(c, cpu, unused, unused, unused);
    ts_params *cw = ts_masters(c);
    rp_model_destroy(c);
    for (int i = 0; i < CALLS; ++i)
        printf("call %d loss gpu %.6f cpu %.6f; upload for the next call %d, own stage-0 "
               "upload %d, own stage-1 upload %d\n", i, gpu[i], cpu[i], carried[i], own[i],
               own1[i]);
    for (int i = 0; i < CALLS; ++i)
        assert_true(fabs(gpu[i] - cpu[i]) <= 1e-4 * fabs(cpu[i]));
    ts_assert_params_close(gw, cw, 1e-3, "weights after the sequence");
    ts_params_free(gw);
    ts_params_free(cw);
    /* Calls 1 to 3 follow a paused async step: the call before each uploaded for it, and each
     * used that upload, for its first two jobs (stages 0 and 1: the memory cap has room). */
    for (int i = 1; i <= 3; ++i) {
        assert_true(carried[i - 1]);
        assert_false(own[i]);
        assert_false(own1[i]);
    }
    /* The call after two calls for one step, and the calls after rp_synchronize and after the
     * caller's write, upload stage 0 themselves. */
    assert_true(own[5] && own1[5]);
    assert_true(own[7] && own1[7]);
    assert_true(own[8] && own1[8]);
    assert_true(own[0]);
}

int main(void) {
    int32_t gpus = 0;
    if (rp_cuda_device_count(&gpus) != RP_OK || gpus == 0) {
        printf("no GPU visible: skipped\n");
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(model_four_times_the_cap_trains_under_the_cap),
        cmocka_unit_test(out_of_memory_names_the_stage_and_the_model_stays_usable),
        cmocka_unit_test(lm_head_loss_chunks_follow_a_small_cap),
        cmocka_unit_test(early_uploads_for_the_next_call_give_the_cpu_results),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
