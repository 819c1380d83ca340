// What every kernel test shares: the device it runs on (RP_TEST_DEVICE), seeded inputs, and a
// closeness check that names the quantity, the worst element and the tolerance it broke.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/autograd/autograd.h>

namespace kt {

// Exit status ctest reads as "skipped" (SKIP_RETURN_CODE in tests/kernels/CMakeLists.txt).
constexpr int kSkip = 77;

// The device RP_TEST_DEVICE names ("cpu" when unset); false when it asks for cuda and none is
// visible, so main() can exit kSkip.
inline bool test_device(c10::Device &device) {
    const char *env = std::getenv("RP_TEST_DEVICE");
    const std::string name = env ? env : "cpu";
    if (name == "cuda") {
        if (!at::hasCUDA() || at::detail::getCUDAHooks().getNumGPUs() < 1) {
            std::printf("SKIP: RP_TEST_DEVICE=cuda but no CUDA device is visible\n");
            return false;
        }
        device = c10::Device(c10::kCUDA, 0);
        return true;
    }
    if (name != "cpu") {
        std::printf("RP_TEST_DEVICE must be cpu or cuda, got %s\n", name.c_str());
        std::exit(2);
    }
    device = c10::Device(c10::kCPU);
    return true;
}

// Normal(0, 1) values drawn on the CPU (the same numbers on every device), then moved.
inline at::Tensor randn(at::IntArrayRef shape, at::ScalarType dtype, c10::Device device,
                        double scale = 1.0, double shift = 0.0) {
    return (at::randn(shape, at::kDouble) * scale + shift).to(dtype).to(device);
}

// A contiguous tensor whose data starts 2 bytes past a 16-byte boundary: the kernels must take
// their scalar (unvectorised) path for it.
inline at::Tensor misaligned(const at::Tensor &t) {
    at::Tensor flat = at::empty({t.numel() + 1}, t.options());
    at::Tensor view = flat.narrow(0, 1, t.numel()).view(t.sizes());
    view.copy_(t);
    return view;
}

// Element i passes when |got - want| <= rtol * |want| + atol * max|want|: a relative bound for
// each element plus an absolute one scaled by the tensor's magnitude, which covers elements
// that cancellation (a - b of close values) makes small.
struct Tol {
    double rtol;
    double atol;
};

class Checker {
  public:
    void close(const std::string &what, const at::Tensor &got, const at::Tensor &want, Tol tol) {
        ++checks_;
        if (!got.defined() || !want.defined() || got.sizes() != want.sizes()) {
            fail(what + ": shape or definedness differs");
            return;
        }
        if (got.scalar_type() != want.scalar_type()) {
            fail(what + ": dtype " + c10::toString(got.scalar_type()) +
                 " != " + c10::toString(want.scalar_type()));
            return;
        }
        at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
        if (!at::isfinite(g).all().item<bool>() || !at::isfinite(w).all().item<bool>()) {
            fail(what + ": non-finite values");
            return;
        }
        const double scale = w.numel() ? w.abs().max().item<double>() : 0.0;
        at::Tensor err = (g - w).abs();
        at::Tensor bound = tol.rtol * w.abs() + tol.atol * scale;
        at::Tensor excess = err - bound;
        if (std::getenv("RP_TEST_VERBOSE") && err.numel() > 0)
            // How much of its tolerance a check uses: the margin a tolerance change would eat.
            std::printf("  %-70s max|err| %.3g, worst err/bound %.3f\n", what.c_str(),
                        err.max().item<double>(),
                        (err / bound.clamp_min(1e-300)).max().item<double>());
        if (excess.numel() == 0 || excess.max().item<double>() <= 0.0)
            return;
        const int64_t at_index = excess.flatten().argmax().item<int64_t>();
        char buf[512];
        std::snprintf(buf, sizeof buf,
                      "%s: element %lld is %.9g, want %.9g (|err| %.3g > rtol %.3g * |want| + "
                      "atol %.3g * max|want| %.3g); max |err| %.3g",
                      what.c_str(), static_cast<long long>(at_index),
                      g.flatten()[at_index].item<double>(), w.flatten()[at_index].item<double>(),
                      err.flatten()[at_index].item<double>(), tol.rtol, tol.atol, scale,
                      err.max().item<double>());
        fail(buf);
    }

    // A check of an exact property (a flag, a count): `message` says what broke when !ok.
    void expect(bool ok, const std::string &message) {
        ++checks_;
        if (!ok)
            fail(message);
    }

    void fail(const std::string &message) {
        ++failures_;
        std::printf("FAIL %s\n", message.c_str());
    }

    int finish(const char *name) const {
        std::printf("%s: %d checks, %d failures\n", name, checks_, failures_);
        return failures_ == 0 ? 0 : 1;
    }

  private:
    int checks_ = 0;
    int failures_ = 0;
};

inline std::string describe(at::ScalarType dtype, at::IntArrayRef shape, const char *note = "") {
    std::string s = std::string(c10::toString(dtype)) + " [";
    for (size_t i = 0; i < shape.size(); ++i)
        s += (i ? "," : "") + std::to_string(shape[i]);
    return s + "]" + note;
}

} // namespace kt
