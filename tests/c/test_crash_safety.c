/*
 * test_crash_safety.c - a save killed at any moment (kill -9) leaves a checkpoint that loads as
 * all-old or all-new weights, in every format: rp_model_save (one safetensors file) and
 * rp_model_save_hf in one file and in shards; and whatever a killed save left behind is gone
 * after the next save to the same place.
 *
 * The test process itself never touches libtorch: a process forked after thread pools started
 * has none of their threads. Every model lives in a child. A saver, forked anew for each kill,
 * saves two generations of weights in turn and records in shared memory which save is under way;
 * the test kills it at a random moment. A checker, forked once per format, then loads what the
 * kill left, compares every element with the generation it must be, saves it back (the next
 * save) and lists the folder.
 */
#define _GNU_SOURCE
#include "test_support.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Big enough that a save takes a while (about 0.6 MB of fp32), small enough for 300+ kills. */
static const char *CONFIG =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 512, \"hidden_size\": 64,"
    " \"intermediate_size\": 128, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
    " \"num_key_value_heads\": 2, \"head_dim\": 16, \"tie_word_embeddings\": false,"
    " \"dtype\": \"float32\"}";

enum { KILLS = 100, SHARDS = 4, MAX_PARAMS = 64 };

typedef enum format { PLAIN, HF_SINGLE, HF_SHARDED } format;
static const char *FORMAT_NAMES[] = {"rp_model_save", "rp_model_save_hf, one file",
                                     "rp_model_save_hf, 4 shards"};

/* Element j of parameter i in generation g (1 or 2): integers, exact in fp32, different in every
 * generation and parameter, so a torn file, a mixed pair of shards or a shifted tensor shows. */
static float value_of(int g, size_t i, int64_t j) {
    return (float)(g * 100000 + (int)i * 1000 + (int)(j % 997));
}

/* What the saver is doing, in memory shared with the test (written by the saver only). */
typedef struct progress {
    int in_progress; /* generation of the save under way, 0 between saves */
    int completed;   /* generation of the last save that returned RP_OK */
    double save_ms;  /* duration of that save */
} progress;

/* The checker's answer after each kill. */
typedef struct verdict {
    int ok;
    int generation;  /* of the weights the load gave */
    int temporaries; /* temporary files found before the next save */
    int orphans;     /* shard files the index did not name, before the next save */
    double save_ms;  /* at start-up: time of one save */
    char message[512];
} verdict;

/* ---- in the children (no cmocka: a failed assertion would unwind into the parent's copy) ---- */

typedef struct child_model {
    rp_model *model;
    size_t count;
    int64_t numel[MAX_PARAMS];
    float *values[3][MAX_PARAMS]; /* [generation][parameter] */
} child_model;

#define CHILD_OK(call)                                                                             \
    do {                                                                                           \
        rp_status s_ = (call);                                                                     \
        if (s_ != RP_OK) {                                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                          \
                    rp_last_error_message());                                                      \
            _exit(3);                                                                              \
        }                                                                                          \
    } while (0)

static void child_model_init(child_model *c) {
    rp_model_options *o = NULL;
    CHILD_OK(rp_model_options_create(&o));
    CHILD_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 1));
    CHILD_OK(rp_model_options_set_model_dtype(o, RP_DTYPE_F32));
    CHILD_OK(rp_model_create_from_hf_config(&c->model, CONFIG, o));
    rp_model_options_destroy(o);
    CHILD_OK(rp_param_count(&c->count, c->model));
    if (c->count > MAX_PARAMS)
        _exit(4);
    for (size_t i = 0; i < c->count; ++i) {
        int64_t shape[8];
        int32_t nd = 0;
        CHILD_OK(rp_param_shape(shape, &nd, 8, c->model, i));
        c->numel[i] = 1;
        for (int32_t d = 0; d < nd; ++d)
            c->numel[i] *= shape[d];
        for (int g = 1; g <= 2; ++g) {
            c->values[g][i] = malloc(sizeof(float) * (size_t)c->numel[i]);
            for (int64_t j = 0; j < c->numel[i]; ++j)
                c->values[g][i][j] = value_of(g, i, j);
        }
    }
}

static void set_generation(child_model *c, int g) {
    CHILD_OK(rp_synchronize(c->model));
    for (size_t i = 0; i < c->count; ++i) {
        DLManagedTensor *t = NULL;
        CHILD_OK(rp_param_master(&t, c->model, i));
        memcpy((char *)t->dl_tensor.data + t->dl_tensor.byte_offset, c->values[g][i],
               sizeof(float) * (size_t)c->numel[i]);
        t->deleter(t);
    }
    CHILD_OK(rp_synchronize(c->model));
}

static rp_status save(child_model *c, format f, const char *target) {
    return f == PLAIN ? rp_model_save(c->model, target) : rp_model_save_hf(c->model, target);
}

static rp_status load(child_model *c, format f, const char *target) {
    return f == PLAIN ? rp_model_load(c->model, target) : rp_model_load_hf(c->model, target);
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void write_text(const char *path, const char *text) {
    FILE *fp = fopen(path, "w");
    if (!fp || fputs(text, fp) < 0 || fclose(fp) != 0)
        _exit(5);
}

/* A sharded Hugging Face directory of generation 1 in `dir` (parameter i in shard i % SHARDS),
 * written by the reference's safetensors writer: loading it gives a model its sharded layout. */
static void write_sharded_source(child_model *c, const char *dir) {
    static int64_t shapes[MAX_PARAMS][8];
    static char names[MAX_PARAMS][256], files[SHARDS][64];
    ref_st_entry entries[SHARDS][MAX_PARAMS];
    size_t n[SHARDS] = {0};
    char *index = malloc(65536);
    snprintf(index, 65536, "{\"metadata\": {}, \"weight_map\": {");
    for (int s = 0; s < SHARDS; ++s)
        snprintf(files[s], sizeof files[s], "model-%05d-of-%05d.safetensors", s + 1, SHARDS);
    for (size_t i = 0; i < c->count; ++i) {
        const char *hf = NULL;
        int32_t nd = 0;
        CHILD_OK(rp_param_hf_name(&hf, c->model, i));
        CHILD_OK(rp_param_shape(shapes[i], &nd, 8, c->model, i));
        snprintf(names[i], sizeof names[i], "%s", hf);
        int s = (int)(i % SHARDS);
        entries[s][n[s]++] = (ref_st_entry){names[i], "F32", nd, shapes[i], c->values[1][i]};
        size_t len = strlen(index);
        snprintf(index + len, 65536 - len, "%s\"%s\": \"%s\"", i ? ", " : "", names[i], files[s]);
    }
    strcat(index, "}}");
    char path[4096];
    for (int s = 0; s < SHARDS; ++s) {
        snprintf(path, sizeof path, "%s/%s", dir, files[s]);
        if (ref_st_write(path, entries[s], n[s]) != 0)
            _exit(6);
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    write_text(path, index);
    snprintf(path, sizeof path, "%s/config.json", dir);
    write_text(path, CONFIG);
    free(index);
}

/* Saves generations start, 3 - start, start, ... until killed. */
static void run_saver(format f, const char *target, const char *source, int start, progress *p,
                      int ready_fd) {
    child_model c;
    child_model_init(&c);
    if (f == HF_SHARDED)
        CHILD_OK(rp_model_load_hf(c.model, source));
    if (write(ready_fd, "r", 1) != 1)
        _exit(7);
    for (int k = 0;; ++k) {
        const int g = k % 2 ? 3 - start : start;
        set_generation(&c, g);
        __atomic_store_n(&p->in_progress, g, __ATOMIC_SEQ_CST);
        const double t0 = now_ms();
        CHILD_OK(save(&c, f, target));
        p->save_ms = now_ms() - t0;
        __atomic_store_n(&p->completed, g, __ATOMIC_SEQ_CST);
        __atomic_store_n(&p->in_progress, 0, __ATOMIC_SEQ_CST);
    }
}

static int has_suffix(const char *s, const char *tail) {
    size_t a = strlen(s), b = strlen(tail);
    return a >= b && strcmp(s + a - b, tail) == 0;
}

static char *slurp(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    char *buf = calloc(1, 1 << 20);
    size_t n = fread(buf, 1, (1 << 20) - 1, fp);
    buf[n] = '\0';
    fclose(fp);
    return buf;
}

/* Counts what a killed save left in `dir` (temporaries; for shards, files the index does not
 * name) and, with `strict`, reports anything that is not part of the checkpoint. */
static void survey(format f, const char *dir, verdict *v, int strict) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    char *index = f == HF_SHARDED ? slurp(path) : NULL;
    DIR *d = opendir(dir);
    if (!d) {
        v->ok = 0;
        snprintf(v->message, sizeof v->message, "cannot list %s", dir);
        free(index);
        return;
    }
    int shards = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        const char *name = e->d_name;
        if (!strcmp(name, ".") || !strcmp(name, ".."))
            continue;
        int expected = 0;
        if (strstr(name, ".tmp.") || strstr(name, ".rp-partial")) {
            v->temporaries += !strict;
        } else if (f == PLAIN) {
            expected = !strcmp(name, "model.safetensors");
        } else if (!strcmp(name, "config.json")) {
            expected = 1;
        } else if (f == HF_SINGLE) {
            expected = !strcmp(name, "model.safetensors");
        } else if (!strcmp(name, "model.safetensors.index.json")) {
            expected = index != NULL;
        } else if (has_suffix(name, ".safetensors")) {
            char quoted[512];
            snprintf(quoted, sizeof quoted, "\"%s\"", name);
            expected = index && strstr(index, quoted);
            shards += expected;
            v->orphans += !expected && !strict;
        }
        if (strict && !expected && v->ok) {
            v->ok = 0;
            snprintf(v->message, sizeof v->message, "after the next save, %s/%s is still there",
                     dir, name);
        }
    }
    closedir(d);
    if (strict && f == HF_SHARDED && shards != SHARDS && v->ok) {
        v->ok = 0;
        snprintf(v->message, sizeof v->message, "the index names %d shard files, not %d", shards,
                 SHARDS);
    }
    free(index);
}

/* Loads `target`, checks that every element is that of one generation, saves it back. */
static void check_once(child_model *c, format f, const char *target, const char *dir, verdict *v) {
    memset(v, 0, sizeof *v);
    v->ok = 1;
    survey(f, dir, v, 0);
    if (load(c, f, target) != RP_OK) {
        v->ok = 0;
        snprintf(v->message, sizeof v->message, "load failed: %s", rp_last_error_message());
        return;
    }
    CHILD_OK(rp_synchronize(c->model));
    for (size_t i = 0; i < c->count && v->ok; ++i) {
        DLManagedTensor *t = NULL;
        CHILD_OK(rp_param_master(&t, c->model, i));
        const float *data =
            (const float *)((const char *)t->dl_tensor.data + t->dl_tensor.byte_offset);
        if (i == 0)
            v->generation = data[0] == value_of(1, 0, 0) ? 1 : data[0] == value_of(2, 0, 0) ? 2 : 0;
        for (int64_t j = 0; j < c->numel[i]; ++j)
            if (v->generation == 0 || data[j] != value_of(v->generation, i, j)) {
                v->ok = 0;
                snprintf(v->message, sizeof v->message,
                         "mixed weights: parameter %zu element %lld is %.1f, generation %d has "
                         "%.1f",
                         i, (long long)j, data[j], v->generation,
                         v->generation ? value_of(v->generation, i, j) : 0.0f);
                break;
            }
        t->deleter(t);
    }
    if (!v->ok)
        return;
    if (save(c, f, target) != RP_OK) {
        v->ok = 0;
        snprintf(v->message, sizeof v->message, "the next save failed: %s",
                 rp_last_error_message());
        return;
    }
    survey(f, dir, v, 1);
}

/* Commits generation 1 into `target`, reports one save's time, then checks on every byte
 * received ('c') until 'q'. */
static void run_checker(format f, const char *target, const char *dir, const char *source,
                        int cmd_fd, int out_fd) {
    child_model c;
    child_model_init(&c);
    set_generation(&c, 1);
    if (f == HF_SHARDED) {
        write_sharded_source(&c, source);
        CHILD_OK(rp_model_load_hf(c.model, source));
    }
    verdict v;
    memset(&v, 0, sizeof v);
    const double t0 = now_ms();
    for (int k = 0; k < 4; ++k)
        CHILD_OK(save(&c, f, target));
    v.ok = 1;
    v.generation = 1;
    v.save_ms = (now_ms() - t0) / 4;
    if (write(out_fd, &v, sizeof v) != sizeof v)
        _exit(8);
    char cmd;
    while (read(cmd_fd, &cmd, 1) == 1 && cmd == 'c') {
        check_once(&c, f, target, dir, &v);
        if (write(out_fd, &v, sizeof v) != sizeof v)
            _exit(8);
    }
    rp_model_destroy(c.model);
    _exit(0);
}

/* ---- in the test process ------------------------------------------------------------------ */

/* fork() for a child that must not outlive the test process (a failed assertion leaves the
 * test's children to the teardown, or, should the process die, to this). */
static pid_t fork_child(void) {
    const pid_t parent = getpid();
    pid_t p = fork();
    if (p == 0 && (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent))
        _exit(9);
    return p;
}

/* What a kill test holds, released by its teardown whether the test passed or not. */
static struct run {
    char *dir, *source;
    pid_t checker, saver;
    int cmd, out; /* the checker's pipes, -1 when closed */
    progress *shared;
} run = {NULL, NULL, 0, 0, -1, -1, NULL};

static void stop(pid_t *pid) {
    if (*pid > 0) {
        kill(*pid, SIGKILL);
        waitpid(*pid, NULL, 0);
    }
    *pid = 0;
}

static void close_fd(int *fd) {
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

static void remove_dir(char **dir) {
    if (*dir) {
        ts_rmdir(*dir);
        free(*dir);
    }
    *dir = NULL;
}

static int end_run(void **state) {
    (void)state;
    stop(&run.saver);
    stop(&run.checker);
    close_fd(&run.cmd);
    close_fd(&run.out);
    if (run.shared)
        munmap(run.shared, sizeof *run.shared);
    run.shared = NULL;
    remove_dir(&run.dir);
    remove_dir(&run.source);
    return 0;
}

/* Reads exactly `size` bytes from `fd` within `seconds`; 0 on success. */
static int read_within(int fd, void *buf, size_t size, int seconds) {
    size_t got = 0;
    while (got < size) {
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, seconds * 1000);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        ssize_t n = read(fd, (char *)buf + got, size - got);
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    return 0;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double uniform01(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

/* A fresh folder in memory (tmpfs) where there is one: a kill -9 leaves the page cache as it is
 * on any file system, and the saves' fsyncs, which only matter for power cuts, cost nothing
 * there, so the kills are many and quick. */
static char *scratch_dir(void) {
    char tmpl[] = "/dev/shm/rp-crash-XXXXXX";
    char *d = mkdtemp(tmpl);
    return d ? strdup(d) : ts_tempdir();
}

static void kill_saves_at_random_moments(format f) {
    const char *dir = run.dir = scratch_dir();
    const char *source = run.source = scratch_dir();
    char target[4096];
    if (f == PLAIN)
        snprintf(target, sizeof target, "%s/model.safetensors", dir);
    else
        snprintf(target, sizeof target, "%s", dir);
    const double t0 = now_ms();

    int cmd[2], out[2];
    assert_int_equal(pipe(cmd), 0);
    assert_int_equal(pipe(out), 0);
    run.cmd = cmd[1];
    run.out = out[0];
    const pid_t checker = run.checker = fork_child();
    assert_true(checker >= 0);
    if (checker == 0) {
        close(cmd[1]);
        close(out[0]);
        run_checker(f, target, dir, source, cmd[0], out[1]);
    }
    close(cmd[0]);
    close(out[1]);
    verdict v;
    assert_int_equal(read_within(out[0], &v, sizeof v, 120), 0);
    assert_true(v.ok);
    /* How long a save takes, followed as the machine's load changes. */
    double save_ms = v.save_ms;

    progress *p = mmap(NULL, sizeof *p, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    assert_true(p != MAP_FAILED);
    run.shared = p;
    int committed = 1, mid_save = 0, new_after_mid = 0, left_temporaries = 0, left_orphans = 0;
    int seen[3] = {0, 0, 0};
    for (int k = 0; k < KILLS; ++k) {
        const int start = 3 - committed;
        p->in_progress = 0;
        p->completed = committed;
        p->save_ms = 0;
        int ready[2];
        assert_int_equal(pipe(ready), 0);
        const pid_t saver = run.saver = fork_child();
        assert_true(saver >= 0);
        if (saver == 0) {
            close(ready[0]);
            close(cmd[1]);
            close(out[0]);
            run_saver(f, target, source, start, p, ready[1]);
        }
        close(ready[1]);
        char byte;
        int rc = read_within(ready[0], &byte, 1, 120);
        close(ready[0]);
        if (rc != 0)
            fail_msg("%s: the saver did not start", FORMAT_NAMES[f]);
        /* Anywhere in the next two to three saves (a save also sets the weights first). */
        const double delay_ms = uniform01() * 2.5 * save_ms;
        struct timespec ts = {(time_t)(delay_ms / 1e3), (long)(fmod(delay_ms, 1e3) * 1e6)};
        nanosleep(&ts, NULL);
        kill(saver, SIGKILL);
        int status = 0;
        assert_int_equal(waitpid(saver, &status, 0), saver);
        run.saver = 0;
        if (!WIFSIGNALED(status))
            fail_msg("%s: the saver stopped by itself (status %d)", FORMAT_NAMES[f], status);
        const int in_progress = __atomic_load_n(&p->in_progress, __ATOMIC_SEQ_CST);
        const int completed = __atomic_load_n(&p->completed, __ATOMIC_SEQ_CST);
        if (p->save_ms > 0)
            save_ms = 0.7 * save_ms + 0.3 * p->save_ms;

        assert_int_equal(write(cmd[1], "c", 1), 1);
        assert_int_equal(read_within(out[0], &v, sizeof v, 120), 0);
        if (!v.ok)
            fail_msg("%s, kill %d (%.2f ms into the saves): %s", FORMAT_NAMES[f], k, delay_ms,
                     v.message);
        /* A save that returned is in place; one under way may or may not have switched. */
        if (v.generation != completed && v.generation != in_progress)
            fail_msg("%s, kill %d: loaded generation %d, but the last completed save wrote %d "
                     "and the one under way %d",
                     FORMAT_NAMES[f], k, v.generation, completed, in_progress);
        mid_save += in_progress != 0;
        new_after_mid += in_progress != 0 && v.generation == in_progress;
        left_temporaries += v.temporaries > 0;
        left_orphans += v.orphans > 0;
        seen[v.generation]++;
        committed = v.generation; /* the checker saved it back */
    }
    assert_int_equal(write(cmd[1], "q", 1), 1);
    int status = 0;
    assert_int_equal(waitpid(checker, &status, 0), checker);
    run.checker = 0;
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    print_message("%s: %d kills in %.1f s (one save about %.2f ms): %d during a save (%d of them "
                  "already showed the new weights), %d left temporaries and %d unnamed shards, "
                  "all removed by the next save; loads: %d x generation 1, %d x generation 2, "
                  "0 mixed\n",
                  FORMAT_NAMES[f], KILLS, (now_ms() - t0) / 1e3, save_ms, mid_save, new_after_mid,
                  left_temporaries, left_orphans, seen[1], seen[2]);
    /* The random moments did reach inside the saves. */
    assert_true(mid_save >= KILLS / 4);
}

static void killed_single_file_save_loads_as_all_old_or_all_new(void **state) {
    (void)state;
    kill_saves_at_random_moments(PLAIN);
}

static void killed_single_file_hf_save_loads_as_all_old_or_all_new(void **state) {
    (void)state;
    kill_saves_at_random_moments(HF_SINGLE);
}

static void killed_sharded_hf_save_loads_as_all_old_or_all_new(void **state) {
    (void)state;
    kill_saves_at_random_moments(HF_SHARDED);
}

/* ---- leftovers, deterministically (these run last: they use models in this process) ---- */

/* A pid that no longer runs (a child that exited and was reaped) and one that does. */
static pid_t dead_pid(void) {
    pid_t p = fork();
    assert_true(p >= 0);
    if (p == 0)
        _exit(0);
    assert_int_equal(waitpid(p, NULL, 0), p);
    return p;
}

static pid_t live_pid(void) {
    pid_t p = fork_child();
    assert_true(p >= 0);
    if (p == 0) {
        for (;;)
            pause();
    }
    return p;
}

static void touch(const char *dir, const char *name) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    fputs("left behind", fp);
    fclose(fp);
}

static int present(const char *dir, const char *name) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct stat st;
    return stat(path, &st) == 0;
}

static rp_model *hf_model_here(void) {
    rp_model_options *o = NULL;
    TS_OK(rp_model_options_create(&o));
    TS_OK(rp_model_options_set_devices(o, RP_DEVICE_CPU, 1));
    TS_OK(rp_model_options_set_model_dtype(o, RP_DTYPE_F32));
    rp_model *m = NULL;
    TS_OK(rp_model_create_from_hf_config(&m, CONFIG, o));
    rp_model_options_destroy(o);
    return m;
}

/* rp_model_save removes "<path>.tmp.<pid>" of dead processes only, and only for its own path. */
static void single_file_save_removes_temporaries_of_dead_savers_only(void **state) {
    (void)state;
    char *dir = ts_tempdir();
    const pid_t dead = dead_pid(), live = live_pid();
    char name[256];
    snprintf(name, sizeof name, "m.safetensors.tmp.%d", (int)dead);
    touch(dir, name);
    char live_tmp[256], other[256];
    snprintf(live_tmp, sizeof live_tmp, "m.safetensors.tmp.%d", (int)live);
    touch(dir, live_tmp);
    snprintf(other, sizeof other, "other.safetensors.tmp.%d", (int)dead);
    touch(dir, other);
    rp_model *m = hf_model_here();
    char path[4200];
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    TS_OK(rp_model_save(m, path));
    assert_false(present(dir, name));
    assert_true(present(dir, live_tmp)); /* its writer may still be at work */
    assert_true(present(dir, other));    /* another file's */
    assert_int_equal(ts_dir_entries(dir), 3);
    TS_OK(rp_model_load(m, path));
    kill(live, SIGKILL);
    waitpid(live, NULL, 0);
    rp_model_destroy(m);
    ts_rmdir(dir);
    free(dir);
}

/* Shards alternate between the layout's names and a generation tag, the index always names a
 * complete set, and the next save removes what killed saves left (temporaries of dead
 * processes, older versions' .rp-partial files, tagged shards no index names) but nothing of a
 * running process and nothing that is not the checkpoint's. Changing layout removes the other
 * layout's files. */
static void sharded_saves_switch_by_index_and_clean_up(void **state) {
    (void)state;
    char *src = ts_tempdir(), *out = ts_tempdir();
    child_model c; /* the helpers are plain C; here they run in this process */
    memset(&c, 0, sizeof c);
    c.model = hf_model_here();
    TS_OK(rp_param_count(&c.count, c.model));
    for (size_t i = 0; i < c.count; ++i) {
        int64_t shape[8];
        int32_t nd = 0;
        TS_OK(rp_param_shape(shape, &nd, 8, c.model, i));
        c.numel[i] = 1;
        for (int32_t d = 0; d < nd; ++d)
            c.numel[i] *= shape[d];
        for (int g = 1; g <= 2; ++g) {
            c.values[g][i] = malloc(sizeof(float) * (size_t)c.numel[i]);
            for (int64_t j = 0; j < c.numel[i]; ++j)
                c.values[g][i][j] = value_of(g, i, j);
        }
    }
    write_sharded_source(&c, src);
    TS_OK(rp_model_load_hf(c.model, src));
    static const char *plain[SHARDS] = {
        "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
        "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"};
    static const char *tagged[SHARDS] = {
        "model-00001-of-00004.rp-gen1.safetensors", "model-00002-of-00004.rp-gen1.safetensors",
        "model-00003-of-00004.rp-gen1.safetensors", "model-00004-of-00004.rp-gen1.safetensors"};

    TS_OK(rp_model_save_hf(c.model, out)); /* a fresh folder: the layout's own names */
    for (int s = 0; s < SHARDS; ++s)
        assert_true(present(out, plain[s]));
    assert_int_equal(ts_dir_entries(out), SHARDS + 2);

    const pid_t dead = dead_pid(), live = live_pid();
    char dead_shard[256], dead_config[256], live_index[256], foreign[256];
    snprintf(dead_shard, sizeof dead_shard, "%s.tmp.%d", tagged[0], (int)dead);
    snprintf(dead_config, sizeof dead_config, "config.json.tmp.%d", (int)dead);
    snprintf(live_index, sizeof live_index, "model.safetensors.index.json.tmp.%d", (int)live);
    snprintf(foreign, sizeof foreign, "notes.txt.tmp.%d", (int)dead);
    const char *leftovers[] = {dead_shard, dead_config,
                               "model-00002-of-00004.safetensors.rp-partial",
                               "model-00003-of-00004.rp-gen7.safetensors"};
    for (size_t k = 0; k < 4; ++k)
        touch(out, leftovers[k]);
    touch(out, live_index);
    touch(out, foreign);
    touch(out, "tokenizer.json");

    /* Generation 2 goes beside generation 1, under tagged names. */
    set_generation(&c, 2);
    TS_OK(rp_model_save_hf(c.model, out));
    for (int s = 0; s < SHARDS; ++s) {
        assert_false(present(out, plain[s]));
        assert_true(present(out, tagged[s]));
    }
    for (size_t k = 0; k < 4; ++k)
        assert_false(present(out, leftovers[k]));
    assert_true(present(out, live_index));
    assert_true(present(out, foreign));
    assert_true(present(out, "tokenizer.json"));
    assert_int_equal(ts_dir_entries(out), SHARDS + 2 + 3);
    rp_model *back = NULL;
    TS_OK(rp_model_create_from_hf(&back, out, NULL));
    ts_params *w = ts_masters(back);
    for (size_t i = 0; i < w->count; ++i)
        assert_memory_equal(w->data[i], c.values[2][i], sizeof(float) * (size_t)w->numel[i]);
    ts_params_free(w);

    /* Loading the tagged folder and saving back: the layout's own names again. */
    TS_OK(rp_model_load_hf(back, out));
    TS_OK(rp_model_save_hf(back, out));
    for (int s = 0; s < SHARDS; ++s) {
        assert_true(present(out, plain[s]));
        assert_false(present(out, tagged[s]));
    }
    assert_int_equal(ts_dir_entries(out), SHARDS + 2 + 3);

    /* A single-file save over the shards removes the index and the shards... */
    rp_model *single = hf_model_here();
    TS_OK(rp_model_save_hf(single, out));
    assert_true(present(out, "model.safetensors"));
    assert_false(present(out, "model.safetensors.index.json"));
    for (int s = 0; s < SHARDS; ++s)
        assert_false(present(out, plain[s]));
    assert_int_equal(ts_dir_entries(out), 2 + 3);
    /* ...and a sharded save over the single file removes model.safetensors. */
    TS_OK(rp_model_save_hf(back, out));
    assert_false(present(out, "model.safetensors"));
    assert_true(present(out, "model.safetensors.index.json"));
    assert_int_equal(ts_dir_entries(out), SHARDS + 2 + 3);
    TS_OK(rp_model_load_hf(single, out));
    ts_params *a = ts_masters(single), *b = ts_masters(back);
    ts_assert_params_equal(a, b);
    ts_params_free(a);
    ts_params_free(b);

    kill(live, SIGKILL);
    waitpid(live, NULL, 0);
    for (size_t i = 0; i < c.count; ++i)
        for (int g = 1; g <= 2; ++g)
            free(c.values[g][i]);
    rp_model_destroy(single);
    rp_model_destroy(back);
    rp_model_destroy(c.model);
    ts_rmdir(src);
    ts_rmdir(out);
    free(src);
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(killed_single_file_save_loads_as_all_old_or_all_new, end_run),
        cmocka_unit_test_teardown(killed_single_file_hf_save_loads_as_all_old_or_all_new, end_run),
        cmocka_unit_test_teardown(killed_sharded_hf_save_loads_as_all_old_or_all_new, end_run),
        cmocka_unit_test(single_file_save_removes_temporaries_of_dead_savers_only),
        cmocka_unit_test(sharded_saves_switch_by_index_and_clean_up),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
