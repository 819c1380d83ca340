// Shared by the libFuzzer targets of tests/fuzz: the status check every call goes through, CPU
// model options, a private scratch folder, and snapshots of a model's master weights.
//
// A target fails (aborts, so libFuzzer saves the input) when a call returns RP_ERR_INTERNAL
// ("a bug in RoundPipe"), a status a CPU-only, callback-free call cannot return (RP_ERR_CUDA,
// RP_ERR_CALLBACK, an unknown code), an error without a message, or when a failed call changed
// the model. Crashes, leaks and sanitizer reports fail it by themselves.
//
// RP_FUZZ_VERBOSE=1 prints every call's status and message (to check a corpus by hand:
// `fuzz_load -runs=0 corpus/fuzz_load`). RP_FUZZ_REPORT_DIR=<dir> is for long survey runs: a
// failed check no longer aborts; the first input of each kind of failure (its message with the
// numbers blanked) is written to <dir>/<hash>.input with the message in <dir>/<hash>.txt, and the
// run goes on. Crashes and sanitizer reports still stop it (or use -fork=1 -ignore_crashes=1).
#pragma once

#include <roundpipe.h>

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace fz {

inline bool verbose() {
    static const bool v = [] {
        const char *e = std::getenv("RP_FUZZ_VERBOSE");
        return e && *e && std::strcmp(e, "0") != 0;
    }();
    return v;
}

[[noreturn]] inline void failure(const char *call, const std::string &what) {
    std::fprintf(stderr, "\n==== RoundPipe fuzz failure: %s %s\n", call, what.c_str());
    std::fflush(stderr);
    std::abort();
}

// The input being run, for report().
struct Input {
    const uint8_t *data = nullptr;
    size_t size = 0;
};
inline Input &current_input() {
    static Input input;
    return input;
}
inline void set_input(const uint8_t *data, size_t size) { current_input() = {data, size}; }

std::string scratch_dir();

// A failed check: aborts, or with RP_FUZZ_REPORT_DIR records the input and goes on.
inline void report(const char *call, const std::string &what) {
    const char *dir = std::getenv("RP_FUZZ_REPORT_DIR");
    if (!dir || !*dir)
        failure(call, what);
    std::string key = std::string(call) + " " + what, norm;
    const std::string scratch = scratch_dir();
    for (size_t at; !scratch.empty() && (at = key.find(scratch)) != std::string::npos;)
        key.replace(at, scratch.size(), "<scratch>");
    for (char c : key) {
        bool digit = c >= '0' && c <= '9';
        if (!digit || norm.empty() || norm.back() != '#')
            norm += digit ? '#' : c;
    }
    char hash[32];
    std::snprintf(hash, sizeof hash, "%016zx", std::hash<std::string>()(norm));
    std::string base = std::string(dir) + "/" + hash;
    if (access((base + ".txt").c_str(), F_OK) == 0)
        return;
    std::ofstream(base + ".input", std::ios::binary)
        .write(reinterpret_cast<const char *>(current_input().data),
               static_cast<std::streamsize>(current_input().size));
    std::ofstream(base + ".txt") << call << " " << what << "\n";
    std::fprintf(stderr, "\n==== RoundPipe fuzz failure (recorded in %s.input): %s %s\n",
                 base.c_str(), call, what.c_str());
}

// Checks the status of `call`. Returns it, so a target can branch on success.
inline rp_status check(rp_status s, const char *call) {
    const char *msg = rp_last_error_message();
    if (verbose())
        std::fprintf(stderr, "[fuzz] %s -> %s%s%s\n", call, rp_status_string(s),
                     s == RP_OK ? "" : ": ", s == RP_OK ? "" : (msg ? msg : "(null)"));
    if (s == RP_OK)
        return s;
    switch (s) {
    case RP_ERR_INVALID_ARGUMENT:
    case RP_ERR_OUT_OF_MEMORY:
    case RP_ERR_IO:
    case RP_ERR_STATE:
        break;
    default:
        report(call, std::string("returned ") + std::to_string(static_cast<int>(s)) + " (" +
                         rp_status_string(s) + "): " + (msg ? msg : "(null message)"));
    }
    if (!msg || !*msg)
        report(call, std::string("returned ") + rp_status_string(s) + " without a message");
    return s;
}

inline void quiet_logs() {
    if (!verbose())
        rp_set_log_callback([](int32_t, const char *, void *) {}, RP_LOG_ERROR, nullptr);
}

// Options for every model the targets build: one CPU worker device, a fixed seed. Never freed.
inline const rp_model_options *cpu_options() {
    static rp_model_options *options = [] {
        rp_model_options *o = nullptr;
        if (rp_model_options_create(&o) != RP_OK ||
            rp_model_options_set_devices(o, RP_DEVICE_CPU, 1) != RP_OK ||
            rp_model_options_set_seed(o, 1) != RP_OK)
            failure("rp_model_options_*", rp_last_error_message());
        return o;
    }();
    return options;
}

inline void remove_tree(const std::string &path) {
    struct stat st;
    if (lstat(path.c_str(), &st) != 0)
        return;
    if (S_ISDIR(st.st_mode)) {
        if (DIR *d = opendir(path.c_str())) {
            while (struct dirent *e = readdir(d)) {
                if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
                    remove_tree(path + "/" + e->d_name);
            }
            closedir(d);
        }
        rmdir(path.c_str());
    } else {
        unlink(path.c_str());
    }
}

// A private folder under $TMPDIR (default /tmp), removed at exit. A crash leaves it behind:
// names start with rp-fuzz-.
class Scratch {
  public:
    static Scratch &get() {
        static Scratch *s = new Scratch; // never destroyed: the exit handler below still needs it
        return *s;
    }
    const std::string &dir() const { return dir_; }
    std::string path(const std::string &name) const { return dir_ + "/" + name; }
    // Empties the folder (what an earlier input or a save left there).
    void clear() const {
        if (DIR *d = opendir(dir_.c_str())) {
            while (struct dirent *e = readdir(d)) {
                if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
                    remove_tree(dir_ + "/" + e->d_name);
            }
            closedir(d);
        }
    }
    void write(const std::string &name, const uint8_t *data, size_t size) const {
        std::string p = path(name);
        FILE *f = std::fopen(p.c_str(), "wb");
        if (!f || (size && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0)
            failure("write", "could not write " + p);
    }
    void write(const std::string &name, const std::string &text) const {
        write(name, reinterpret_cast<const uint8_t *>(text.data()), text.size());
    }

  private:
    Scratch() {
        const char *tmp = std::getenv("TMPDIR");
        std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/rp-fuzz-XXXXXX";
        std::vector<char> buf(templ.begin(), templ.end());
        buf.push_back('\0');
        if (!mkdtemp(buf.data()))
            failure("mkdtemp", templ);
        dir_ = buf.data();
        std::atexit([] { remove_tree(Scratch::get().dir()); });
    }
    std::string dir_;
};

inline std::string scratch_dir() { return Scratch::get().dir(); }

// The fp32 master weights of a model, copied, to check that a failed call changed nothing.
struct Weights {
    std::vector<std::vector<uint8_t>> bytes;

    static Weights of(rp_model *model) {
        Weights w;
        size_t n = 0;
        if (rp_param_count(&n, model) != RP_OK)
            failure("rp_param_count", rp_last_error_message());
        for (size_t i = 0; i < n; ++i) {
            DLManagedTensor *t = nullptr;
            if (rp_synchronize(model) != RP_OK || rp_param_master(&t, model, i) != RP_OK)
                failure("rp_param_master", rp_last_error_message());
            const DLTensor &d = t->dl_tensor;
            size_t numel = 1;
            for (int32_t k = 0; k < d.ndim; ++k)
                numel *= static_cast<size_t>(d.shape[k]);
            const uint8_t *p = static_cast<const uint8_t *>(d.data) + d.byte_offset;
            w.bytes.emplace_back(p, p + numel * (d.dtype.bits / 8));
            if (t->deleter)
                t->deleter(t);
        }
        return w;
    }
    bool operator==(const Weights &o) const { return bytes == o.bytes; }
};

} // namespace fz
