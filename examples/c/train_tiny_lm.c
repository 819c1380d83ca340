/*
 * train_tiny_lm.c - the first run: train a small causal language model on real English text for
 * about a minute and watch it learn.
 *
 * The model is a Llama (our decoder layers) built from a Hugging Face config.json text, with a
 * byte-level vocabulary: tokens 0..255 are the bytes of the text, 256 ends a document, 257 pads
 * (declared for transformers; training never pads). The text is every licence under
 * /usr/share/common-licenses, which every Debian machine has. The program
 *   - prints a greedy sample of the untrained model, then the loss every 25 steps as it falls,
 *   - prints a greedy sample of the trained model (generation by repeated rp_forward over the
 *     growing sequence: no KV cache, fine for a few dozen bytes),
 *   - saves the model as a Hugging Face directory OUT/model (transformers loads it; the Python
 *     twin, examples/python/train_tiny_lm.py, does) and loads it back to check its logits,
 *   - writes the losses to OUT/losses.csv and draws OUT/loss.png by running
 *     examples/python/plot_loss.py (C has no plotting library; that script needs matplotlib,
 *     which scripts/setup.sh installs).
 *
 * Usage: train_tiny_lm [--out DIR] [--steps N] [--data PATH] [--device cpu|auto] [--check]
 *   --out DIR      where the model, losses.csv and loss.png go (default roundpipe-first-run)
 *   --steps N      training steps (default 500: about a minute on 2 CPU cores)
 *   --data PATH    a text file or a folder of them (default /usr/share/common-licenses)
 *   --device cpu   one CPU worker device; auto (default): every visible GPU, else the CPU
 *   --check        exit with failure unless the loss fell by half and the plot was drawn
 * Environment: PYTHON names the interpreter that draws the plot (default python3).
 */
#define _POSIX_C_SOURCE 200809L

#include "example_util.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

/* The model: 256 bytes + end of document + padding; 2 decoder layers of width 128. */
enum { VOCAB = 258, END_OF_DOC = 256 };
static const char *const CONFIG =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\","
    " \"vocab_size\": 258, \"hidden_size\": 128, \"intermediate_size\": 384,"
    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 4,"
    " \"hidden_act\": \"silu\", \"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-5,"
    " \"rope_theta\": 10000.0, \"tie_word_embeddings\": false, \"initializer_range\": 0.02,"
    " \"bos_token_id\": 256, \"eos_token_id\": 256, \"pad_token_id\": 257, \"dtype\": \"float32\"}";

/* Training: BATCH windows of SEQ bytes at random places of the text per step. */
enum { BATCH = 16, SEQ = 64, DEFAULT_STEPS = 500, PRINT_EVERY = 25, SAMPLE_BYTES = 60 };
/* AdamW with beta2 0.95, as usual for language models; a higher rate stalls longer at the
 * byte-frequency plateau (loss ~3). */
static const double LEARNING_RATE = 5e-4, BETA1 = 0.9, BETA2 = 0.95;
static const char *const PROMPT = "You may ";

/* ------------------------------------------------------------------------------------------ */
/* The text: every regular file of a folder (symbolic links are aliases there), in name order,
 * as one token array with END_OF_DOC after each file. */

typedef struct text {
    int64_t *tokens;
    size_t count, capacity;
} text;

static int text_push(text *t, int64_t token) {
    if (t->count == t->capacity) {
        size_t capacity = t->capacity ? 2 * t->capacity : (size_t)1 << 16;
        int64_t *grown = (int64_t *)realloc(t->tokens, capacity * sizeof(int64_t));
        if (grown == NULL)
            return -1;
        t->tokens = grown;
        t->capacity = capacity;
    }
    t->tokens[t->count++] = token;
    return 0;
}

static int text_append_file(text *t, const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return -1;
    }
    int c, status = 0;
    while (status == 0 && (c = fgetc(f)) != EOF)
        status = text_push(t, c);
    fclose(f);
    return status == 0 ? text_push(t, END_OF_DOC) : status;
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int text_load(text *t, const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "%s: %s (pass --data FILE_OR_FOLDER with English text)\n", path,
                strerror(errno));
        return -1;
    }
    if (!S_ISDIR(st.st_mode))
        return text_append_file(t, path);
    DIR *dir = opendir(path);
    if (dir == NULL) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return -1;
    }
    char *names[1024];
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL && n < 1024) {
        char full[4096];
        snprintf(full, sizeof(full), "%s/%s", path, e->d_name);
        if (lstat(full, &st) == 0 && S_ISREG(st.st_mode))
            names[n++] = strdup(full);
    }
    closedir(dir);
    qsort(names, n, sizeof(names[0]), compare_names);
    int status = 0;
    for (size_t i = 0; i < n; ++i) {
        if (status == 0)
            status = text_append_file(t, names[i]);
        free(names[i]);
    }
    return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Greedy generation: append the most likely next token until SAMPLE_BYTES are added or the
 * model ends the document. Each step runs the whole sequence again (no KV cache). */

static void print_sample(const char *label, rp_model *model) {
    int64_t ids[SEQ + SAMPLE_BYTES];
    size_t length = strlen(PROMPT);
    for (size_t i = 0; i < length; ++i)
        ids[i] = (unsigned char)PROMPT[i];
    const size_t prompt_length = length;
    while (length < prompt_length + SAMPLE_BYTES) {
        const int64_t shape[2] = {1, (int64_t)length};
        example_tensor input;
        example_tensor_i64(&input, ids, 2, shape);
        const DLManagedTensor *inputs[1] = {&input.managed};
        rp_tensor_list *outputs = NULL;
        CHECK(rp_forward(&outputs, model, inputs, 1, NULL));
        size_t count = 0;
        float *logits = example_output_copy(outputs, 0, &count); /* [1, length, VOCAB] */
        rp_tensor_list_destroy(outputs);
        if (logits == NULL)
            exit(EXIT_FAILURE);
        const float *last = logits + (length - 1) * VOCAB;
        int64_t best = 0;
        for (int64_t v = 1; v < VOCAB; ++v)
            if (last[v] > last[best])
                best = v;
        free(logits);
        if (best == END_OF_DOC)
            break;
        ids[length++] = best;
    }
    /* Printable ASCII as it is; anything else as an escape, so the terminal stays sane. */
    printf("%s \"", label);
    for (size_t i = 0; i < length; ++i) {
        int64_t c = ids[i];
        if (c == '\n')
            printf("\\n");
        else if (c == '"' || c == '\\')
            printf("\\%c", (int)c);
        else if (c >= 32 && c < 127)
            putchar((int)c);
        else
            printf("\\x%02x", (unsigned)(c & 0xff));
    }
    printf("\"\n");
    fflush(stdout);
}

/* ------------------------------------------------------------------------------------------ */

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 64-bit linear congruential generator (Knuth's MMIX constants): where the windows start. */
static uint64_t next_random(uint64_t *state) {
    *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
    return *state >> 11;
}

/* Runs `PYTHON plot_loss.py csv png` and waits for it. Returns its exit status (-1: not run). */
static int draw_plot(const char *csv, const char *png) {
#ifdef RP_PLOT_SCRIPT
    const char *python = getenv("PYTHON");
    if (python == NULL || python[0] == '\0')
        python = "python3";
    const char *args[] = {python, RP_PLOT_SCRIPT, csv, png, "--title", "train_tiny_lm (C)", NULL};
    char **argv = (char **)args; /* posix_spawnp's type; it does not write them */
    extern char **environ;
    pid_t pid;
    int err = posix_spawnp(&pid, python, NULL, NULL, argv, environ);
    if (err != 0) {
        fprintf(stderr, "cannot run %s: %s\n", python, strerror(err));
        return -1;
    }
    int status = 0;
    if (waitpid(pid, &status, 0) < 0)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
#else
    (void)csv;
    (void)png;
    return -1;
#endif
}

int main(int argc, char **argv) {
    const char *out = "roundpipe-first-run", *data = "/usr/share/common-licenses";
    int steps = DEFAULT_STEPS, check = 0;
    int32_t device_kind = RP_DEVICE_AUTO;
    for (int a = 1; a < argc; ++a) {
        if (strcmp(argv[a], "--out") == 0 && a + 1 < argc) {
            out = argv[++a];
        } else if (strcmp(argv[a], "--steps") == 0 && a + 1 < argc) {
            steps = atoi(argv[++a]);
        } else if (strcmp(argv[a], "--data") == 0 && a + 1 < argc) {
            data = argv[++a];
        } else if (strcmp(argv[a], "--device") == 0 && a + 1 < argc &&
                   (strcmp(argv[a + 1], "cpu") == 0 || strcmp(argv[a + 1], "auto") == 0)) {
            device_kind = strcmp(argv[++a], "cpu") == 0 ? RP_DEVICE_CPU : RP_DEVICE_AUTO;
        } else if (strcmp(argv[a], "--check") == 0) {
            check = 1;
        } else {
            fprintf(stderr,
                    "usage: %s [--out DIR] [--steps N] [--data PATH] [--device cpu|auto] "
                    "[--check]\n",
                    argv[0]);
            return EXIT_FAILURE;
        }
    }
    if (steps < 1) {
        fprintf(stderr, "--steps must be at least 1\n");
        return EXIT_FAILURE;
    }
    if (mkdir(out, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "%s: %s\n", out, strerror(errno));
        return EXIT_FAILURE;
    }

    text corpus = {NULL, 0, 0};
    if (text_load(&corpus, data) != 0 || corpus.count <= SEQ) {
        fprintf(stderr, "%s: not enough text to train on\n", data);
        return EXIT_FAILURE;
    }
    printf("text: %zu bytes from %s\n", corpus.count, data);

    /* Saving and loading the model show their progress on one line of stderr. */
    CHECK(rp_set_progress_callback(example_show_progress, NULL));

    /* One microbatch per call: the batch is small, and on CPU splitting it only adds work. */
    rp_model_options *options = NULL;
    rp_run_config *config = NULL;
    rp_model *model = NULL;
    CHECK(rp_model_options_create(&options));
    CHECK(rp_model_options_set_seed(options, 0));
    CHECK(rp_model_options_set_devices(options, device_kind, device_kind == RP_DEVICE_CPU ? 1 : 0));
    CHECK(rp_run_config_create(&config));
    CHECK(rp_run_config_set_num_microbatch(config, 1));
    CHECK(rp_model_options_set_run_config(options, config));
    CHECK(rp_model_create_from_hf_config(&model, CONFIG, options));
    int32_t devices = 0;
    CHECK(rp_model_num_devices(&devices, model));
    printf("model: Llama, 2 layers of width 128, %d device(s)\n", (int)devices);

    print_sample("sample before training:", model);

    rp_loss *loss = NULL;
    rp_optimizer *adamw = NULL;
    CHECK(rp_loss_create(&loss, RP_LOSS_CAUSAL_LM)); /* mean over the batch's next-byte targets */
    CHECK(rp_optimizer_create(&adamw, RP_OPTIMIZER_ADAMW));
    CHECK(rp_optimizer_set_learning_rate(adamw, LEARNING_RATE));
    CHECK(rp_optimizer_set_betas(adamw, BETA1, BETA2));
    CHECK(rp_optimizer_set_weight_decay(adamw, 0.0));

    static int64_t batch[BATCH][SEQ];
    const int64_t shape[2] = {BATCH, SEQ};
    example_tensor ids, labels;
    example_tensor_i64(&ids, &batch[0][0], 2, shape);
    /* A causal LM's labels are its inputs: token t is scored against token t + 1. */
    example_tensor_i64(&labels, &batch[0][0], 2, shape);
    const DLManagedTensor *inputs[1] = {&ids.managed};

    double *losses = (double *)malloc((size_t)steps * sizeof(double));
    if (losses == NULL)
        return EXIT_FAILURE;
    uint64_t state = 1;
    const double start = seconds_now();
    for (int step = 0; step < steps; ++step) {
        for (int b = 0; b < BATCH; ++b)
            memcpy(batch[b], corpus.tokens + next_random(&state) % (corpus.count - SEQ),
                   SEQ * sizeof(int64_t));
        CHECK(rp_forward_backward(&losses[step], NULL, model, inputs, 1, &labels.managed, loss,
                                  NULL));
        /* Asynchronous: the update runs on the optimizer thread during the next step. */
        CHECK(rp_step(model, adamw, 1));
        if (step % PRINT_EVERY == 0 || step == steps - 1) {
            printf("step %4d  loss %.3f  (%.0f s)\n", step, losses[step], seconds_now() - start);
            fflush(stdout);
        }
    }
    CHECK(rp_synchronize(model));
    const double elapsed = seconds_now() - start;
    const int tail = steps < 10 ? steps : 10;
    double last = 0.0;
    for (int i = steps - tail; i < steps; ++i)
        last += losses[i] / tail;
    printf("trained %d steps in %.1f s: loss %.3f at the start, %.3f over the last %d steps "
           "(%.0f%% of the start)\n",
           steps, elapsed, losses[0], last, tail, 100.0 * last / losses[0]);

    print_sample("sample after training: ", model);

    /* Save as a Hugging Face directory, load it back, compare the logits of one window. */
    char path[4200], png[4200];
    snprintf(path, sizeof(path), "%s/model", out);
    CHECK(rp_model_save_hf(model, path));
    rp_model *reloaded = NULL;
    CHECK(rp_model_create_from_hf(&reloaded, path, options));
    rp_tensor_list *a = NULL, *b = NULL;
    CHECK(rp_forward(&a, model, inputs, 1, NULL));
    CHECK(rp_forward(&b, reloaded, inputs, 1, NULL));
    size_t n_a = 0, n_b = 0;
    float *logits_a = example_output_copy(a, 0, &n_a), *logits_b = example_output_copy(b, 0, &n_b);
    const int comparable = logits_a != NULL && logits_b != NULL && n_a == n_b;
    double worst = comparable ? 0.0 : INFINITY;
    for (size_t i = 0; comparable && i < n_a; ++i) {
        const double d = fabs((double)logits_a[i] - (double)logits_b[i]);
        if (!(d <= worst)) /* a NaN is the worst */
            worst = d;
    }
    printf("saved %s; reloaded, max |logit difference| %.3g\n", path, worst);
    int status = worst <= 1e-5 ? EXIT_SUCCESS : EXIT_FAILURE;
    free(logits_a);
    free(logits_b);
    rp_tensor_list_destroy(a);
    rp_tensor_list_destroy(b);

    /* The losses as CSV, and the plot drawn from them. */
    snprintf(path, sizeof(path), "%s/losses.csv", out);
    snprintf(png, sizeof(png), "%s/loss.png", out);
    FILE *csv = fopen(path, "w");
    if (csv == NULL) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return EXIT_FAILURE;
    }
    fprintf(csv, "step,loss\n");
    for (int i = 0; i < steps; ++i)
        fprintf(csv, "%d,%.6f\n", i, losses[i]);
    fclose(csv);
    remove(png);
    const int plot = draw_plot(path, png);
    struct stat st;
    const int have_plot = plot == 0 && stat(png, &st) == 0;
    if (have_plot)
        printf("losses: %s, plot: %s\n", path, png);
    else
        printf("losses: %s; no plot (run: python3 examples/python/plot_loss.py %s %s; it needs "
               "matplotlib)\n",
               path, path, png);

    if (check) {
        if (!(last <= 0.5 * losses[0])) {
            fprintf(stderr, "check failed: the loss did not fall by half\n");
            status = EXIT_FAILURE;
        }
        if (!have_plot) {
            fprintf(stderr, "check failed: no plot\n");
            status = EXIT_FAILURE;
        }
    }

    free(losses);
    free(corpus.tokens);
    rp_model_destroy(reloaded);
    rp_model_destroy(model);
    rp_optimizer_destroy(adamw);
    rp_loss_destroy(loss);
    rp_run_config_destroy(config);
    rp_model_options_destroy(options);
    return status;
}
