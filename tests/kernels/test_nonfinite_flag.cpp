// rp::kernels::nonfinite_flag (src/kernels/nonfinite.*) against values placed by hand: 0 for
// finite data (including the largest finite values, whose sum overflows fp32), +inf when one
// element is +inf, -inf or nan, wherever it sits: first, in the 16-byte vectors' body, in the
// tail after them, last; in fp32, bf16 and fp16, for sizes with and without a tail, misaligned
// storage (the scalar path), a non-contiguous view, and a tensor larger than one sweep of the
// GPU grid (and than one task of the CPU loop); float64 too. RP_TEST_DEVICE=cuda runs the GPU
// kernel; on the CPU it checks the CPU twin.
#include <cmath>
#include <limits>

#include "kernel_test.h"
#include "kernels/nonfinite.h"

namespace {

enum class Layout { Contiguous, Misaligned, Transposed };

// The flag's value, read on the host; a check fails unless it is exactly 0 or exactly +inf.
double flag_of(const at::Tensor &t) {
    const at::Tensor f = rp::kernels::nonfinite_flag(t);
    if (f.dim() != 0 || f.scalar_type() != at::kDouble || f.device() != t.device())
        return std::numeric_limits<double>::quiet_NaN();
    return f.item<double>();
}

void expect(kt::Checker &c, const std::string &what, const at::Tensor &t, bool finite) {
    const double got = flag_of(t);
    const bool ok = finite ? got == 0.0 : (std::isinf(got) && got > 0);
    c.expect(ok, what + ": flag " + std::to_string(got) + ", want " + (finite ? "0" : "+inf"));
}

at::Tensor laid_out(const at::Tensor &cpu, c10::Device device, Layout layout) {
    at::Tensor t = cpu.to(device);
    if (layout == Layout::Misaligned)
        return kt::misaligned(t);
    if (layout == Layout::Transposed) // [2, n/2] stored as its transpose's contiguous data
        return t.view({2, -1}).t().contiguous().t();
    return t;
}

void check(kt::Checker &c, at::ScalarType dtype, c10::Device device, int64_t n, Layout layout) {
    const char *note = layout == Layout::Misaligned   ? " misaligned"
                       : layout == Layout::Transposed ? " transposed"
                                                      : "";
    const std::string name = "nonfinite " + kt::describe(dtype, {n}, note);
    at::Tensor data = kt::randn({n}, dtype, at::kCPU);
    expect(c, name + " random", laid_out(data, device, layout), true);
    if (n == 0)
        return;
    // Every element the largest finite value: finite, though an fp32 sum of two is inf.
    const double largest = dtype == at::kDouble     ? std::numeric_limits<double>::max()
                           : dtype == at::kFloat    ? std::numeric_limits<float>::max()
                           : dtype == at::kBFloat16 ? 3.3895313892515355e38
                                                    : 65504.0;
    expect(c, name + " largest finite",
           laid_out(at::full({n}, largest, data.options()), device, layout), true);
    const double bad_values[] = {std::numeric_limits<double>::infinity(),
                                 -std::numeric_limits<double>::infinity(),
                                 std::numeric_limits<double>::quiet_NaN()};
    const char *bad_names[] = {"+inf", "-inf", "nan"};
    // First, the middle (in the vectors' body when there is one), the last (in the tail when
    // n is not a whole number of vectors).
    for (int64_t at_index : {int64_t{0}, n / 2, n - 1}) {
        for (int b = 0; b < 3; ++b) {
            at::Tensor bad = data.clone();
            bad[at_index] = bad_values[b];
            expect(c, name + " " + bad_names[b] + " at " + std::to_string(at_index),
                   laid_out(bad, device, layout), false);
        }
    }
}

} // namespace

int main() {
    c10::Device device(c10::kCPU);
    if (!kt::test_device(device))
        return kt::kSkip;
    at::manual_seed(19);
    kt::Checker c;
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
        // 0 (nothing to read), 1 and 7 (a tail only in fp32/bf16), 8 and 1000 (whole vectors in
        // bf16), 8195 (vectors and a tail), 3,000,017 (several sweeps of a GPU grid).
        for (int64_t n : {0, 1, 7, 8, 9, 1000, 8195, 3000017})
            check(c, dtype, device, n, Layout::Contiguous);
        for (int64_t n : {1, 13, 8195})
            check(c, dtype, device, n, Layout::Misaligned);
        check(c, dtype, device, 1000, Layout::Transposed);
    }
    // float64 (the CPU loop; ATen's isfinite on a GPU): 1e300 is finite though no narrower type
    // holds it.
    for (int64_t n : {0, 9, 8195, 3000017})
        check(c, at::kDouble, device, n, Layout::Contiguous);
    expect(c, "nonfinite float64 1e300",
           at::full({5}, 1e300, at::TensorOptions().dtype(at::kDouble)).to(device), true);
    // Integers have no inf or nan: ATen's answer on every device.
    expect(c, "nonfinite int64", at::arange(10, at::TensorOptions().dtype(at::kLong)).to(device),
           true);
    return c.finish("test_nonfinite_flag");
}
