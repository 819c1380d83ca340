// Known-bad kernels for the compute-sanitizer step of scripts/gpu-check.sh. Before the GPU tests
// run under a tool, this program runs under the same tool and kernel filter, and the step fails
// unless the tool reports it: a clean report of the tests then means the tool attached and its
// filter matched our kernels, not that it looked at nothing.
//
//   sanitizer_control race   a shared-memory race (racecheck reports it)
//   sanitizer_control oob    a write past the end of an allocation (memcheck reports it)
//
// The kernels sit in rp::kernels, the namespace of src/kernels, so a filter that selects our
// kernels selects these too. Run without a sanitizer, the program exits 0: the faults are real
// but harmless in a process of its own.
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

namespace rp::kernels {
namespace {

// Every thread stores its index into its own shared slot, then reads the slot of the thread one
// warp ahead, with no barrier between: a read of another warp's write (a read-after-write hazard).
__global__ void racy_shared_read(int *out) {
    extern __shared__ int slots[];
    const unsigned n = blockDim.x;
    slots[threadIdx.x] = static_cast<int>(threadIdx.x);
    out[threadIdx.x] = slots[(threadIdx.x + 32) % n];
}

// One thread writes the element just past the end of an n-element buffer.
__global__ void write_past_end(int *buffer, int n) {
    if (threadIdx.x == 0)
        buffer[n] = 1;
}

} // namespace
} // namespace rp::kernels

int main(int argc, char **argv) {
    const bool race = argc == 2 && std::strcmp(argv[1], "race") == 0;
    const bool oob = argc == 2 && std::strcmp(argv[1], "oob") == 0;
    if (!race && !oob) {
        std::fprintf(stderr, "usage: %s race|oob\n", argv[0]);
        return 2;
    }
    constexpr int kThreads = 256; // eight warps: racecheck's hazards are between warps
    int *buffer = nullptr;
    if (cudaMalloc(&buffer, kThreads * sizeof(int)) != cudaSuccess) {
        std::fprintf(stderr, "no GPU memory\n");
        return 77;
    }
    if (race)
        rp::kernels::racy_shared_read<<<1, kThreads, kThreads * sizeof(int)>>>(buffer);
    else
        rp::kernels::write_past_end<<<1, kThreads>>>(buffer, kThreads);
    const cudaError_t status = cudaDeviceSynchronize();
    std::printf("%s kernel ran: %s\n", race ? "racy" : "out-of-bounds", cudaGetErrorString(status));
    cudaFree(buffer);
    return 0;
}
