// safetensors files: an 8-byte little-endian header length, a JSON header mapping each tensor name
// to {dtype, shape, data_offsets}, then the raw little-endian data.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

struct NamedTensor {
    std::string name;
    at::Tensor tensor;
};

// Reads and validates the whole file (header bounds, offsets, dtypes, sizes) before returning
// anything. Throws rp::Error(Io) naming the file and, where it applies, the tensor.
std::vector<NamedTensor> read_safetensors(const std::string &path);

// Maps the file into memory and validates it like read_safetensors; the tensors are read-only
// views of the mapping (any stored dtype), which lives as long as any of them. Reading them
// faults the pages in: nothing is copied before the caller converts what it needs.
std::vector<NamedTensor> map_safetensors(const std::string &path);

// Writes to "<path>.tmp.<pid>" in the same folder, flushes, then renames over `path`, so readers
// never see a half-written file and a failure leaves any old file intact.
void write_safetensors(const std::string &path, const std::vector<NamedTensor> &tensors,
                       const std::map<std::string, std::string> &metadata);

} // namespace rp
