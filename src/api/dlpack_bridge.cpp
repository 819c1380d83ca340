#include "api/dlpack_bridge.h"

#include <iterator>

namespace rp {
namespace {

// "float64", "uint8", "bool", "float32 x 2 lanes"; the raw code for a kind DLPack added later.
std::string dtype_name(DLDataType t) {
    // Indexed by DLDataTypeCode, kDLInt (0) to kDLComplex (5).
    static const char *const kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex"};
    std::string name = t.code == kDLBool           ? "bool"
                       : t.code < std::size(kinds) ? kinds[t.code] + std::to_string(t.bits)
                                                   : "(DLPack type code " + std::to_string(t.code) +
                                                         ", " + std::to_string(t.bits) + " bits)";
    return t.lanes == 1 ? name : name + " x " + std::to_string(t.lanes) + " lanes";
}

std::string shape_of(const DLTensor &t) {
    std::string s = "[";
    for (int32_t d = 0; d < t.ndim; ++d)
        s += (d ? ", " : "") + std::to_string(t.shape[d]);
    return s + "]";
}

at::ScalarType scalar_type_of(DLDataType t, const std::string &what, bool allow_float64) {
    if (t.lanes == 1) {
        if (allow_float64 && t.code == kDLFloat && t.bits == 64)
            return at::kDouble;
        if (t.code == kDLFloat && t.bits == 32)
            return at::kFloat;
        if (t.code == kDLFloat && t.bits == 16)
            return at::kHalf;
        if (t.code == kDLBfloat && t.bits == 16)
            return at::kBFloat16;
        if (t.code == kDLInt && t.bits == 64)
            return at::kLong;
        if (t.code == kDLInt && t.bits == 32)
            return at::kInt;
    }
    const bool float64 = t.code == kDLFloat && t.bits == 64 && t.lanes == 1;
    fail(ErrorKind::InvalidArgument, what + " has dtype " + dtype_name(t) +
                                         "; supported: float32, float16, bfloat16, int64, int32" +
                                         (float64 ? " (convert it to float32)" : ""));
}

void validate(const DLTensor &t, const std::string &what, int gpus) {
    if (t.device.device_type == kDLCUDA) {
        require(gpus > 0, what + " is in GPU memory (cuda:" + std::to_string(t.device.device_id) +
                              ") but this model runs on CPU devices; pass host memory");
        require(t.device.device_id >= 0 && t.device.device_id < gpus,
                what + " is on cuda:" + std::to_string(t.device.device_id) +
                    ", which does not exist (" + std::to_string(gpus) + " GPUs visible)");
    }
    require(t.device.device_type == kDLCPU || t.device.device_type == kDLCUDAHost ||
                t.device.device_type == kDLCUDA,
            what + " is on an unsupported device type " +
                std::to_string(static_cast<int>(t.device.device_type)) + "; use host memory");
    require(t.ndim >= 0 && t.ndim <= 16,
            what + " has " + std::to_string(t.ndim) + " dimensions (0 to 16 supported)");
    require(t.ndim == 0 || t.shape != nullptr, what + " has ndim > 0 but no shape");
    int64_t numel = 1;
    bool empty = false;
    for (int32_t d = 0; d < t.ndim; ++d) {
        require(t.shape[d] >= 0, what + " has a negative size in dimension " + std::to_string(d));
        empty = empty || t.shape[d] == 0;
    }
    // The sizes come from outside: their product must fit an int64 (and its bytes too), or a
    // wrapped product could pass every later check.
    for (int32_t d = 0; d < t.ndim && !empty; ++d)
        require(!__builtin_mul_overflow(numel, t.shape[d], &numel),
                what + " has more elements than an int64 can count (shape " + shape_of(t) + ")");
    int64_t bytes = 0;
    require(empty || !__builtin_mul_overflow(numel, int64_t{(t.dtype.bits + 7) / 8}, &bytes),
            what + " has more bytes than an int64 can count (shape " + shape_of(t) + ")");
    require(empty || t.data != nullptr, what + " has no data pointer");
    if (t.strides && !empty) { // an empty tensor has no layout to check
        int64_t expected = 1;
        for (int32_t d = t.ndim - 1; d >= 0; --d) {
            require(t.shape[d] == 1 || t.strides[d] == expected,
                    what + " is not contiguous (stride " + std::to_string(t.strides[d]) +
                        " in dimension " + std::to_string(d) + ", expected " +
                        std::to_string(expected) + "); pass a contiguous copy");
            expected *= t.shape[d];
        }
    }
}

at::ScalarType any_scalar_type(DLDataType t, const std::string &what) {
    try {
        return at::toScalarType(t);
    } catch (const c10::Error &) {
        fail(ErrorKind::InvalidArgument,
             what + " has dtype " + dtype_name(t) + ", which libtorch has no type for");
    }
}

} // namespace

at::Tensor borrow_dlpack(const DLManagedTensor *tensor, const std::string &what, int gpus,
                         bool any_dtype) {
    require(tensor != nullptr, what + " is NULL");
    const DLTensor &t = tensor->dl_tensor;
    validate(t, what, gpus);
    at::ScalarType type =
        any_dtype ? any_scalar_type(t.dtype, what) : scalar_type_of(t.dtype, what, false);
    std::vector<int64_t> sizes(t.shape, t.shape + t.ndim);
    char *data = static_cast<char *>(t.data) + t.byte_offset;
    at::Device device =
        t.device.device_type == kDLCUDA
            ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(t.device.device_id))
            : at::Device(at::kCPU);
    return at::from_blob(data, sizes, at::TensorOptions().dtype(type).device(device));
}

at::Tensor adopt_dlpack(DLManagedTensor *tensor, const std::string &what, bool allow_float64) {
    require(tensor != nullptr, what + " is NULL");
    try {
        validate(tensor->dl_tensor, what, /*gpus=*/0);
        scalar_type_of(tensor->dl_tensor.dtype, what, allow_float64);
    } catch (...) {
        if (tensor->deleter)
            tensor->deleter(tensor);
        throw;
    }
    return at::fromDLPack(tensor);
}

at::Tensor adopt_dlpack_any(DLManagedTensor *tensor, const std::string &what, int gpus) {
    require(tensor != nullptr, what + " is NULL");
    try {
        validate(tensor->dl_tensor, what, gpus);
        any_scalar_type(tensor->dl_tensor.dtype, what);
    } catch (...) {
        if (tensor->deleter)
            tensor->deleter(tensor);
        throw;
    }
    at::Tensor t = at::fromDLPack(tensor);
    // Memory from outside libtorch's caching allocator cannot be stream-ordered: the engine reads
    // a callback's outputs and gradients on its download stream, and record_stream ignores memory
    // it did not allocate, so the caller's allocator (PyTorch's, on the compute stream) could
    // hand the block out again while the download still reads it. A copy on the current (compute)
    // stream is the engine's own; the caller's tensor is released once the copy is enqueued.
    if (t.is_cuda())
        t = t.clone(at::MemoryFormat::Contiguous);
    return t;
}

DLManagedTensor *export_dlpack(const at::Tensor &t) { return at::toDLPack(t); }

} // namespace rp
