// libFuzzer target: rp_model_create with a fuzzed JSON model spec, on one CPU worker device.
// A spec that is accepted is queried (layers, stages, parameter names and shapes) and destroyed.
// Sizes are not screened here: refusing a spec too large for the host is the library's job
// (scripts/sanitize.sh caps single allocations, so such a spec must fail with a status).
#include "fuzz_common.h"

namespace {

void query(rp_model *model) {
    int32_t layers = 0, stages = 0;
    size_t count = 0;
    fz::check(rp_model_num_layers(&layers, model), "rp_model_num_layers");
    fz::check(rp_model_num_stages(&stages, model), "rp_model_num_stages");
    fz::check(rp_param_count(&count, model), "rp_param_count");
    for (size_t i = 0; i < count; ++i) {
        const char *name = nullptr;
        int64_t shape[8];
        int32_t ndim = 0;
        fz::check(rp_param_name(&name, model, i), "rp_param_name");
        fz::check(rp_param_shape(shape, &ndim, 8, model, i), "rp_param_shape");
        size_t back = count;
        if (fz::check(rp_param_find(&back, model, name), "rp_param_find") != RP_OK || back != i)
            fz::report("rp_param_find", std::string("does not find ") + name);
    }
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fz::quiet_logs();
    fz::cpu_options();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz::set_input(data, size);
    std::string spec(reinterpret_cast<const char *>(data), size);
    rp_model *model = nullptr;
    if (fz::check(rp_model_create(&model, spec.c_str(), fz::cpu_options()), "rp_model_create") ==
        RP_OK) {
        query(model);
        rp_model_destroy(model);
    } else if (model) {
        fz::report("rp_model_create", "failed but returned a model");
    }
    return 0;
}
