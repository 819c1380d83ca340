// safetensors files: an 8-byte little-endian header length, a JSON header mapping each tensor name
// to {dtype, shape, data_offsets}, then the raw little-endian data.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "base/progress.h"

namespace rp {

struct NamedTensor {
    NamedTensor() = default;
    NamedTensor(std::string name_, at::Tensor tensor_)
        : name(std::move(name_)), tensor(std::move(tensor_)) {}

    std::string name;
    at::Tensor tensor;
    // For writing only: when set, `tensor` only gives the dtype and shape (a meta tensor will
    // do) and the writer calls produce() for the data when it reaches this tensor, so tensors
    // computed for the file (merged LoRA weights) exist one at a time, never all at once.
    std::function<at::Tensor()> produce;
};

// Decides from a tensor's header entry alone whether read_safetensors reads it: false skips it
// (its bytes are neither allocated nor read); throwing refuses the file.
using TensorFilter =
    std::function<bool(const std::string &name, at::ScalarType type, at::IntArrayRef shape)>;

// Validates the whole header (bounds, offsets inside the data against the file's real size,
// dtypes, shapes whose size must fit int64) before reading anything, then reads the tensors
// `wanted` accepts (all when empty). Throws rp::Error(Io) naming the file and, where it applies,
// the tensor. The bytes read are reported as the operation "load <path>".
std::vector<NamedTensor> read_safetensors(const std::string &path,
                                          const TensorFilter &wanted = nullptr);

// Maps the file into memory and validates it like read_safetensors; the tensors are read-only
// views of the mapping (any stored dtype), which lives as long as any of them. Reading them
// faults the pages in: nothing is copied before the caller converts what it needs.
std::vector<NamedTensor> map_safetensors(const std::string &path);

// Writes to "<path>.tmp.<pid>" in the same folder, syncs it, renames it over `path` and syncs the
// folder, so readers never see a half-written file and a failure or a crash leaves any old file
// intact. Temporaries "<path>.tmp.<pid>" of writers killed earlier are removed first. The tensor
// bytes written advance `progress`, which the caller finishes; without one they are reported as
// the operation "save <path>".
void write_safetensors(const std::string &path, const std::vector<NamedTensor> &tensors,
                       const std::map<std::string, std::string> &metadata,
                       ProgressReport *progress = nullptr);

// Bytes of tensor data `tensors` hold (what write_safetensors writes after the header).
int64_t tensor_bytes(const std::vector<NamedTensor> &tensors);

} // namespace rp
