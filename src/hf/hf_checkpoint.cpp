#include "hf/hf_checkpoint.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/log.h"

namespace rp {
namespace {

using json = nlohmann::json;

const char *const kSingleFile = "model.safetensors";
const char *const kIndexFile = "model.safetensors.index.json";
const char *const kPartial = ".rp-partial";

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

std::string read_text(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in)
        fail(ErrorKind::Io, path + ": cannot open: " + std::strerror(errno));
    std::ostringstream s;
    s << in.rdbuf();
    if (in.bad())
        fail(ErrorKind::Io, path + ": read failed");
    return s.str();
}

// Sharded layout from the index: which file holds each tensor.
HfLayout read_index(const std::string &dir) {
    const std::string path = join(dir, kIndexFile);
    json index;
    try {
        index = json::parse(read_text(path));
    } catch (const json::parse_error &e) {
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
        if (file.empty() || file.find('/') != std::string::npos || file[0] == '.')
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

void write_text_file(const std::string &path, const std::string &text) {
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    std::FILE *f = std::fopen(tmp.c_str(), "wb");
    if (!f)
        fail(ErrorKind::Io, path + ": cannot create temporary file: " + std::strerror(errno));
    bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    int saved = errno;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
        if (ok)
            saved = errno;
        std::remove(tmp.c_str());
        fail(ErrorKind::Io, path + ": write failed: " + std::strerror(saved));
    }
}

} // namespace

std::string read_hf_config_text(const std::string &dir) {
    const std::string path = join(dir, "config.json");
    if (!exists(path))
        fail(ErrorKind::Io, path + ": missing (not a Hugging Face model directory?)");
    return read_text(path);
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
    if (!exists(dir) && ::mkdir(dir.c_str(), 0777) != 0)
        fail(ErrorKind::Io, dir + ": cannot create directory: " + std::strerror(errno));

    // Group by file, in the layout's files; a tensor the layout does not place joins the first.
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
        groups[file].push_back(nt);
    }

    std::vector<std::string> finals; // final paths, in rename order: data, index, config
    auto cleanup = [&] {
        for (const std::string &f : finals)
            std::remove((f + kPartial).c_str());
    };
    try {
        json weight_map = json::object();
        uint64_t total = 0;
        for (const auto &g : groups) {
            const std::string path = join(dir, g.first);
            finals.push_back(path);
            write_safetensors(path + kPartial, g.second, {{"format", "pt"}});
            for (const NamedTensor &nt : g.second) {
                weight_map[nt.name] = g.first;
                total += static_cast<uint64_t>(nt.tensor.numel()) * nt.tensor.element_size();
            }
        }
        if (layout.sharded) {
            json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
            finals.push_back(join(dir, kIndexFile));
            write_text_file(finals.back() + kPartial, index.dump(2) + "\n");
        }
        finals.push_back(join(dir, "config.json"));
        write_text_file(finals.back() + kPartial, config_json);
    } catch (...) {
        cleanup();
        throw;
    }
    for (const std::string &f : finals)
        if (std::rename((f + kPartial).c_str(), f.c_str()) != 0) {
            int err = errno;
            cleanup();
            fail(ErrorKind::Io, f + ": rename failed: " + std::strerror(err));
        }
    const std::string stale = join(dir, layout.sharded ? kSingleFile : kIndexFile);
    if (exists(stale) && std::remove(stale.c_str()) != 0)
        log(LogLevel::Warn, stale + ": could not remove the file of the other layout; "
                                    "transformers may load it instead of the saved weights");
}

} // namespace rp
