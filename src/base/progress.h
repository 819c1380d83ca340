// Progress of long operations (weights read from or written to disk). Like the log sink, the
// progress sink is process-wide state the API lets the user replace; an operation reports to
// whichever sink is installed when it reports.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace rp {

using ProgressSink = std::function<void(const std::string &what, int64_t done, int64_t total)>;

// Installs `sink` (empty: no progress reports). Returns once no call to the previous sink is in
// flight, so its user data may be freed.
void set_progress_sink(ProgressSink sink);

// One operation, reported on the thread that runs it: (0, total) when constructed, (done, total)
// after each advance() that leaves done < total, and (total, total) exactly once, by finish().
// An operation that fails is simply dropped: its last report then has done < total.
class ProgressReport {
  public:
    ProgressReport(std::string what, int64_t total);
    ProgressReport(const ProgressReport &) = delete;
    ProgressReport &operator=(const ProgressReport &) = delete;

    void advance(int64_t amount);
    void finish();

  private:
    std::string what_;
    int64_t total_;
    int64_t done_ = 0;
    bool finished_ = false;
};

} // namespace rp
