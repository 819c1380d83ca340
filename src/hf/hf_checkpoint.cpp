#include "hf/hf_checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/log.h"
#include "io/durable_file.h"

namespace rp {
namespace {

using json = nlohmann::json;

const char *const kSingleFile = "model.safetensors";
const char *const kIndexFile = "model.safetensors.index.json";
const char *const kConfigFile = "config.json";
// Written by versions before crash-safe sharded saves; removed by the next save.
const char *const kPartial = ".rp-partial";
// Shards of a sharded save are named "<stem>.rp-gen<N>.safetensors" when the layout's own names
// are in use by the checkpoint being replaced (see save_hf_checkpoint).
const char *const kGenerationTag = ".rp-gen";
const char *const kSafetensorsExt = ".safetensors";

std::string join(const std::string &dir, const std::string &name) {
    return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool exists(const std::string &path) {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
}

std::string shape_str(at::IntArrayRef s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i)
        out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
}

} // namespace

std::string read_text_file(const std::string &path) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
        fail(ErrorKind::Io, path + ": is a directory, not a file");
    std::ifstream in(path, std::ios::binary);
    if (!in)
        fail(ErrorKind::Io, path + ": cannot open: " + std::strerror(errno));
    std::ostringstream s;
    s << in.rdbuf();
    if (in.bad())
        fail(ErrorKind::Io, path + ": read failed");
    return s.str();
}

void ensure_dir(const std::string &dir) {
    if (exists(dir))
        return;
    if (::mkdir(dir.c_str(), 0777) != 0)
        fail(ErrorKind::Io, dir + ": cannot create directory: " + std::strerror(errno));
    const size_t end = dir.find_last_not_of('/');
    sync_dir(parent_dir(end == std::string::npos ? dir : dir.substr(0, end + 1)));
}

namespace {

// Sharded layout from the index: which file holds each tensor.
HfLayout read_index(const std::string &dir) {
    const std::string path = join(dir, kIndexFile);
    json index;
    try {
        index = json::parse(read_text_file(path));
    } catch (const json::exception &e) {
        // Includes numbers out of range (1e400), which nlohmann reports as out_of_range.
        fail(ErrorKind::Io, path + ": not valid JSON: " + e.what());
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
        fail(ErrorKind::Io, path + ": no \"weight_map\" object");
    HfLayout layout;
    layout.sharded = true;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
        if (!it->is_string())
            fail(ErrorKind::Io, path + ": tensor \"" + it.key() + "\" maps to " + it->dump() +
                                    ", not a file name");
        const std::string file = it->get<std::string>();
        if (file.empty() || file.find('/') != std::string::npos || file[0] == '.' ||
            file == kIndexFile || file == kConfigFile)
            fail(ErrorKind::Io, path + ": tensor \"" + it.key() + "\" maps to \"" + file +
                                    "\", not a file in this directory");
        layout.file_of[it.key()] = file;
    }
    return layout;
}

bool ignorable(const std::string &name, const std::vector<std::string> &ignored) {
    // Old Llama checkpoints store the rotary inverse frequencies; they are recomputed.
    static const std::string inv_freq = "rotary_emb.inv_freq";
    if (name.size() >= inv_freq.size() &&
        name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0)
        return true;
    for (const std::string &i : ignored)
        if (i == name)
            return true;
    return false;
}

bool ends_with(const std::string &s, const std::string &tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The generation N of "<stem>.rp-gen<N>.safetensors" (0 for a name without the tag); `plain`
// receives "<stem>.safetensors", the layout's own name.
uint64_t generation_of(const std::string &name, std::string *plain) {
    *plain = name;
    if (!ends_with(name, kSafetensorsExt))
        return 0;
    const std::string stem = name.substr(0, name.size() - std::strlen(kSafetensorsExt));
    const size_t tag = stem.rfind(kGenerationTag);
    if (tag == std::string::npos || tag == 0)
        return 0;
    const std::string digits = stem.substr(tag + std::strlen(kGenerationTag));
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
        return 0;
    *plain = stem.substr(0, tag) + kSafetensorsExt;
    return std::stoull(digits);
}

std::string with_generation(const std::string &plain, uint64_t generation) {
    if (generation == 0 || !ends_with(plain, kSafetensorsExt))
        return plain;
    return plain.substr(0, plain.size() - std::strlen(kSafetensorsExt)) + kGenerationTag +
           std::to_string(generation) + kSafetensorsExt;
}

// Names a save may leave behind as "<name>.tmp.<pid>" when it is killed.
bool is_checkpoint_file(const std::string &name) {
    return name == kConfigFile || name == kIndexFile || ends_with(name, kSafetensorsExt) ||
           ends_with(name, kPartial);
}

// The weight files a load of `dir` may read now: model.safetensors (which transformers
// prefers) and the shards the index names (which RoundPipe prefers).
struct LiveFiles {
    bool single = false, index = false;
    std::set<std::string> shards;
    bool contains(const std::string &name) const {
        return shards.count(name) || (single && name == kSingleFile);
    }
};

LiveFiles live_files(const std::string &dir) {
    LiveFiles live;
    live.single = exists(join(dir, kSingleFile));
    live.index = exists(join(dir, kIndexFile));
    if (live.index) {
        try {
            for (const auto &kv : read_index(dir).file_of)
                live.shards.insert(kv.second);
        } catch (const Error &e) {
            // A broken index loads nothing; the save replaces it.
            log(LogLevel::Warn, std::string("replacing an unreadable index: ") + e.what());
        }
    }
    return live;
}

void remove_logged(const std::string &path, const char *why) {
    if (std::remove(path.c_str()) != 0 && errno != ENOENT)
        log(LogLevel::Warn, path + ": could not remove " + why + ": " + std::strerror(errno));
}

} // namespace

std::string read_hf_config_text(const std::string &dir) {
    const std::string path = join(dir, "config.json");
    if (!exists(path))
        fail(ErrorKind::Io, path + ": missing (not a Hugging Face model directory?)");
    return read_text_file(path);
}

namespace {

// The files of the checkpoint in `dir`, each checked to exist; fills `layout` from the index of
// a sharded checkpoint.
std::vector<std::string> checkpoint_files(const std::string &dir, HfLayout &layout) {
    std::vector<std::string> files;
    if (exists(join(dir, kIndexFile))) {
        layout = read_index(dir);
        std::set<std::string> distinct;
        for (const auto &kv : layout.file_of)
            if (distinct.insert(kv.second).second)
                files.push_back(kv.second);
        for (const std::string &f : files)
            if (!exists(join(dir, f))) {
                std::string example;
                for (const auto &kv : layout.file_of)
                    if (kv.second == f) {
                        example = kv.first;
                        break;
                    }
                fail(ErrorKind::Io, join(dir, f) + ": missing shard (" + kIndexFile +
                                        " maps tensor \"" + example + "\" to it)");
            }
    } else if (exists(join(dir, kSingleFile))) {
        files.push_back(kSingleFile);
    } else {
        fail(ErrorKind::Io, dir + ": no " + std::string(kSingleFile) + " and no " + kIndexFile +
                                " (not a Hugging Face checkpoint directory?)");
    }
    return files;
}

// Tensors of the checkpoint that the model does not use are worth a warning, not an error.
void warn_unused(const std::string &dir,
                 const std::map<std::string, std::map<std::string, at::Tensor>> &by_file,
                 const std::set<std::string> &used, const std::vector<std::string> &ignored) {
    std::vector<std::string> unexpected;
    for (const auto &f : by_file)
        for (const auto &kv : f.second)
            if (!used.count(kv.first) && !ignorable(kv.first, ignored))
                unexpected.push_back(kv.first);
    if (unexpected.empty())
        return;
    std::string list;
    for (size_t i = 0; i < unexpected.size() && i < 5; ++i)
        list += (i ? ", " : "") + ("\"" + unexpected[i] + "\"");
    if (unexpected.size() > 5)
        list += ", ...";
    log(LogLevel::Warn, dir + ": " + std::to_string(unexpected.size()) +
                            " tensor(s) of the checkpoint are not used by the model: " + list);
}

} // namespace

HfCheckpoint open_hf_checkpoint(const std::string &dir, const std::vector<HfTensorSpec> &expected,
                                const std::vector<std::string> &ignored) {
    HfCheckpoint ckpt;
    std::vector<std::string> files = checkpoint_files(dir, ckpt.layout);

    // Every file is mapped and its header validated before any tensor is looked at.
    std::map<std::string, std::map<std::string, at::Tensor>> by_file;
    for (const std::string &f : files)
        for (NamedTensor &nt : map_safetensors(join(dir, f)))
            by_file[f][nt.name] = std::move(nt.tensor);

    std::set<std::string> used;
    for (const HfTensorSpec &spec : expected) {
        std::string file = kSingleFile;
        if (ckpt.layout.sharded) {
            auto it = ckpt.layout.file_of.find(spec.name);
            if (it == ckpt.layout.file_of.end())
                fail(ErrorKind::Io, join(dir, kIndexFile) + ": missing tensor \"" + spec.name +
                                        "\" (the index maps no file to it)");
            file = it->second;
        } else {
            ckpt.layout.file_of[spec.name] = file;
        }
        const std::string path = join(dir, file);
        auto found = by_file[file].find(spec.name);
        if (found == by_file[file].end())
            fail(ErrorKind::Io, path + ": missing tensor \"" + spec.name + "\"");
        const at::Tensor &t = found->second;
        if (!at::isFloatingType(t.scalar_type()))
            fail(ErrorKind::Io, path + ": tensor \"" + spec.name + "\" has dtype " +
                                    c10::toString(t.scalar_type()) +
                                    "; weights must be float32, float16 or bfloat16");
        if (t.sizes() != at::IntArrayRef(spec.shape))
            fail(ErrorKind::Io, path + ": tensor \"" + spec.name + "\" has shape " +
                                    shape_str(t.sizes()) + " but the model expects " +
                                    shape_str(spec.shape));
        ckpt.tensors.push_back(t);
        used.insert(spec.name);
    }

    warn_unused(dir, by_file, used, ignored);
    if (!ckpt.layout.sharded) {
        // Keep only what the model saves back; ignored tensors of a single file need no place.
        for (auto it = ckpt.layout.file_of.begin(); it != ckpt.layout.file_of.end();)
            it = used.count(it->first) ? std::next(it) : ckpt.layout.file_of.erase(it);
    }
    return ckpt;
}

void save_hf_checkpoint(const std::string &dir, const HfLayout &layout,
                        const std::vector<NamedTensor> &tensors, const std::string &config_json) {
    ensure_dir(dir);

    // What saves killed earlier left behind: temporaries, and older versions' partial files.
    remove_stale_temporaries(dir, is_checkpoint_file);
    for (const std::string &name : list_dir(dir))
        if (ends_with(name, kPartial))
            remove_logged(join(dir, name), "the partial file of an interrupted save");
    const LiveFiles live = live_files(dir);

    // Group by file, in the layout's files (by their own names, without a generation tag); a
    // tensor the layout does not place joins the first.
    std::map<std::string, std::vector<NamedTensor>> groups;
    std::string first_file = kSingleFile;
    if (layout.sharded && !layout.file_of.empty()) {
        std::set<std::string> names;
        for (const auto &kv : layout.file_of)
            names.insert(kv.second);
        first_file = *names.begin();
    }
    for (const NamedTensor &nt : tensors) {
        std::string file = first_file;
        if (layout.sharded) {
            auto it = layout.file_of.find(nt.name);
            if (it != layout.file_of.end())
                file = it->second;
        }
        std::string plain;
        generation_of(file, &plain);
        groups[plain].push_back(nt);
    }

    // A sharded save writes its shards beside the live ones, under the layout's own names, or,
    // where a load may be reading one of those, tagged one generation past the newest live tag.
    // Nothing reads them until the index naming them replaces the old index in one rename.
    uint64_t generation = 0;
    if (layout.sharded) {
        for (const auto &g : groups)
            if (live.contains(g.first)) {
                for (const std::string &f : live.shards) {
                    std::string plain;
                    generation = std::max(generation, generation_of(f, &plain));
                }
                ++generation;
                break;
            }
    }
    std::set<std::string> written; // shard names of this generation
    std::string config_tmp, index_tmp;
    auto cleanup = [&] {
        for (const std::string &f : written)
            remove_logged(join(dir, f), "a shard of the failed save");
        for (const std::string *tmp : {&config_tmp, &index_tmp})
            if (!tmp->empty())
                remove_logged(*tmp, "a temporary file of the failed save");
    };
    const std::string config_path = join(dir, kConfigFile), index_path = join(dir, kIndexFile);
    ProgressReport progress("save " + dir, tensor_bytes(tensors));
    try {
        // config.json is rewritten only when it changes, so that a save of the same model
        // replaces the weights alone.
        if (!exists(config_path) || read_text_file(config_path) != config_json)
            config_tmp = stage_text_file(config_path, config_json);
        if (layout.sharded) {
            json weight_map = json::object();
            uint64_t total = 0;
            for (const auto &g : groups) {
                const std::string name = with_generation(g.first, generation);
                written.insert(name);
                write_safetensors(join(dir, name), g.second, {{"format", "pt"}}, &progress);
                for (const NamedTensor &nt : g.second) {
                    weight_map[nt.name] = name;
                    total += static_cast<uint64_t>(nt.tensor.numel()) * nt.tensor.element_size();
                }
            }
            json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
            index_tmp = stage_text_file(index_path, index.dump(2) + "\n");
            sync_dir(dir); // the shards' names are durable before the index names them
            rename_into_place(index_tmp, index_path); // the switch: all old to all new
            index_tmp.clear();
        } else {
            // One file: its rename is the switch.
            write_safetensors(join(dir, kSingleFile), groups[kSingleFile], {{"format", "pt"}},
                              &progress);
        }
        written.clear();
        if (!config_tmp.empty()) {
            rename_into_place(config_tmp, config_path);
            config_tmp.clear();
        }
    } catch (...) {
        cleanup();
        throw;
    }

    // The previous generation goes, in the order that keeps every reader on all-old or all-new:
    // model.safetensors (which transformers prefers) or the index (which RoundPipe prefers)
    // first, then the shards, then shards of saves killed before their switch.
    std::set<std::string> keep;
    if (layout.sharded) {
        for (const auto &g : groups)
            keep.insert(with_generation(g.first, generation));
        if (live.single && !keep.count(kSingleFile))
            remove_logged(join(dir, kSingleFile), "the weights of the previous, single-file save");
    } else {
        keep.insert(kSingleFile);
        if (live.index)
            remove_logged(index_path, "the index of the previous, sharded save");
    }
    for (const std::string &f : live.shards)
        if (!keep.count(f))
            remove_logged(join(dir, f), "a shard of the previous save");
    for (const std::string &name : list_dir(dir)) {
        std::string plain;
        if (generation_of(name, &plain) > 0 && !keep.count(name))
            remove_logged(join(dir, name), "a shard of an interrupted save");
    }
    sync_dir(dir);
    progress.finish();
}

} // namespace rp
