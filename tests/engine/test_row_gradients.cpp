// The rows of an embedding's gradient added into a bf16 gradient (memory-saving mode;
// src/optim/bf16_convert.h, add_rows_into_bf16) against libtorch: the table widened, index_add_ in
// fp32, rounded back to bf16. Bit for bit, with repeated rows, rows no use names left alone, a
// factor (a power of two, so a fused multiply-add gives the same product), and more rows than one
// thread's share; with factor 1 also against index_add_ on the bf16 tensor itself (what the
// accumulator called before; with another factor libtorch rounds after each use there). Then a
// row used 1,000 times by 1.0 must read 1,000: rounding after each use would stop at 256, where
// 256 + 1 rounds back to 256.
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <ATen/ATen.h>

#include "optim/bf16_convert.h"

static int failures = 0;

static void expect(bool ok, const char *what) {
    if (!ok) {
        std::fprintf(stderr, "FAIL: %s\n", what);
        ++failures;
    }
}

static void add_rows(at::Tensor &out, const at::Tensor &rows, const at::Tensor &values,
                     float factor) {
    rp::add_rows_into_bf16(reinterpret_cast<const uint16_t *>(values.data_ptr()),
                           rows.data_ptr<int64_t>(), rows.numel(), out.size(1),
                           reinterpret_cast<uint16_t *>(out.data_ptr()), factor);
}

static void check_against_torch(int64_t table_rows, int64_t width, int64_t n, float factor,
                                const char *what) {
    at::manual_seed(static_cast<uint64_t>(table_rows * 31 + n));
    at::Tensor out = at::randn({table_rows, width}).to(at::kBFloat16);
    // Ids from the lower half of the table: most rows repeat, the upper half stays unused.
    at::Tensor rows = at::randint(0, table_rows / 2 + 1, {n}, at::kLong);
    at::Tensor values = (at::randn({n, width}) * 3).to(at::kBFloat16);
    at::Tensor want =
        out.to(at::kFloat).index_add_(0, rows, values.to(at::kFloat), factor).to(at::kBFloat16);
    at::Tensor got = out.clone();
    add_rows(got, rows, values, factor);
    expect(std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()) == 0, what);
    if (factor == 1.0f) {
        at::Tensor in_bf16 = out.clone().index_add_(0, rows, values);
        expect(std::memcmp(got.data_ptr(), in_bf16.data_ptr(), got.nbytes()) == 0,
               "index_add_ on the bf16 tensor");
    }
    const int64_t upper = table_rows / 2 + 1;
    expect(std::memcmp(got[upper].data_ptr(), out[upper].data_ptr(),
                       static_cast<size_t>((table_rows - upper) * width * 2)) == 0,
           "unused rows untouched");
}

int main() {
    check_against_torch(64, 16, 200, 1.0f, "small table, repeats, factor 1");
    check_against_torch(64, 16, 200, 0.25f, "small table, repeats, factor 1/4");
    check_against_torch(5000, 130, 4096, 1.0f, "rows spread over threads, odd width");
    check_against_torch(3, 7, 1, 1.0f, "a single use");

    const int64_t width = 8, uses = 1000;
    at::Tensor out = at::zeros({4, width}, at::kBFloat16);
    add_rows(out, at::full({uses}, 2, at::kLong), at::ones({uses, width}, at::kBFloat16), 1.0f);
    expect(at::equal(out[2].to(at::kFloat), at::full({width}, 1000.0f)), "1,000 uses read 1,000");
    expect(at::equal(out[0].to(at::kFloat), at::zeros({width})), "other rows stay zero");

    if (failures) {
        std::fprintf(stderr, "%d failure(s)\n", failures);
        return 1;
    }
    std::printf("row gradients into bf16: ok\n");
    return 0;
}
