// The CPU "device": transfers are the identity; the timing record uses the host clock.
#include <chrono>
#include <mutex>

#include "engine/device_lane.h"

namespace rp {

std::unique_ptr<DeviceLane> make_cuda_lane(at::Device device); // cuda_lane.cpp

namespace {

class CpuLane final : public DeviceLane {
  public:
    at::Device device() const override { return at::Device(at::kCPU); }

    void begin_call() override {
        std::lock_guard<std::mutex> lock(mutex_);
        start_ = Clock::now();
        spans_.clear();
    }

    Transfer upload_weights(const std::vector<at::Tensor> &host, size_t) override {
        return {host, nullptr, {}};
    }
    Transfer upload(const Transfer &from, size_t) override { return from; }
    void use(const Transfer &) override {}
    Transfer download(const std::vector<at::Tensor> &t, size_t, Payload,
                      std::shared_ptr<void>) override {
        return {t, nullptr, {}};
    }

    void wait(const Transfer &) override {}

    void compute_begin(size_t) override { compute_start_ = now_ms(); }
    void compute_end(size_t job) override { end_span(job, ""); }
    void compute_end_ahead(size_t job) override { end_span(job, kRecomputeAhead); }

    std::vector<TraceSpan> finish() override {
        std::lock_guard<std::mutex> lock(mutex_);
        return spans_;
    }

  private:
    using Clock = std::chrono::steady_clock;
    double now_ms() const {
        return std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
    }
    void end_span(size_t job, const char *content) {
        double end = now_ms();
        std::lock_guard<std::mutex> lock(mutex_);
        spans_.push_back({"compute", job, compute_start_, end, -1, content});
    }

    std::mutex mutex_;
    Clock::time_point start_ = Clock::now();
    double compute_start_ = 0;
    std::vector<TraceSpan> spans_;
};

} // namespace

std::unique_ptr<DeviceLane> make_device_lane(at::Device device) {
    if (device.is_cuda())
        return make_cuda_lane(device);
    return std::make_unique<CpuLane>();
}

} // namespace rp
