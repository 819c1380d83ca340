// The step gate's runs of open parameters (src/engine/step_gate.h), which upload_stage_weights
// sends up one run at a time as the step opens them: a run ends at the first parameter not yet
// open for the step asked (in the stage's order, whatever the parameters' ids), never before the
// one waited for, and a wait lasts until the step opens that parameter.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "engine/step_gate.h"
#include "engine_check.h"

using engine_test::check;

int main() {
    rp::StepGate gate(8);
    const std::vector<size_t> stage = {5, 2, 7, 1};

    gate.open(5, 3);
    gate.open(7, 3);
    check(gate.wait_run(stage, 0, 3) == 1, "a run ends at the first parameter not open (2)");
    gate.open(2, 3);
    check(gate.wait_run(stage, 0, 3) == 3, "then runs through 5, 2 and 7");
    check(gate.wait_run(stage, 1, 3) == 3, "a run from inside the stage");
    gate.open(1, 2);
    check(gate.wait_run(stage, 0, 2) == 4, "every parameter open for an older step");

    // Parameter 1 holds step 2: a wait for step 3 lasts until the step opens it.
    std::atomic<bool> opened{false};
    std::thread step([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        opened = true;
        gate.open(1, 3);
    });
    const size_t end = gate.wait_run(stage, 3, 3);
    check(opened.load(), "the wait returned only after the step opened the parameter");
    check(end == 4, "and its run is that parameter");
    step.join();

    gate.open_all(4);
    check(gate.wait_run(stage, 0, 4) == 4, "open_all opens the whole stage");
    return engine_test::finish("step gate");
}
