// Hugging Face checkpoint directories: "model.safetensors", or shards listed by
// "model.safetensors.index.json", read through memory maps and written back in the same layout.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "io/safetensors.h"

namespace rp {

// Which file holds each tensor. Single layout: everything in "model.safetensors".
struct HfLayout {
    bool sharded = false;
    std::map<std::string, std::string> file_of; // tensor name -> file name in the directory
};

struct HfTensorSpec {
    std::string name;           // Hugging Face tensor name
    std::vector<int64_t> shape; // what the model expects
};

struct HfCheckpoint {
    HfLayout layout;
    // One tensor per expected name, in the order asked for: read-only views of the mapped files
    // in the stored floating-point dtype.
    std::vector<at::Tensor> tensors;
};

// Opens the checkpoint in `dir` and checks every file it names (header, offsets, sizes) and
// every expected tensor (present, floating point, expected shape) before returning anything.
// Tensors named in `ignored` may be present or not (a tied lm_head.weight). Throws
// rp::Error(Io) naming the file and the tensor. Other tensors found are reported as a warning.
HfCheckpoint open_hf_checkpoint(const std::string &dir, const std::vector<HfTensorSpec> &expected,
                                const std::vector<std::string> &ignored);

// Writes `tensors` into `dir` (created if missing, one level) following `layout` (a tensor the
// layout does not place goes to the first file), with `config_json` as config.json. Crash-safe
// (docs/semantics.md, "Crash safety"): a single file is replaced by one rename; shards are
// written beside the live ones (generation-tagged where the layout's names are live) and the
// index, renamed last, switches to them; then the previous generation and the file of the other
// layout are removed. Temporaries and unnamed shards of killed saves are removed; a failure
// leaves the old checkpoint intact. The tensor bytes written are reported as the operation
// "save <dir>".
void save_hf_checkpoint(const std::string &dir, const HfLayout &layout,
                        const std::vector<NamedTensor> &tensors, const std::string &config_json);

// The whole text of the file at `path`. Throws rp::Error(Io) naming the path (missing, a
// directory, unreadable).
std::string read_text_file(const std::string &path);

// Creates `dir` (one level) when it does not exist, durably (its parent is synced). Throws
// rp::Error(Io) naming it.
void ensure_dir(const std::string &dir);

// Reads `dir`/config.json. Throws rp::Error(Io) naming the path.
std::string read_hf_config_text(const std::string &dir);

} // namespace rp
