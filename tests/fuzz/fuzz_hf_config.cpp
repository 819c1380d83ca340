// libFuzzer target: rp_model_create_from_hf_config with a fuzzed config.json text, on one CPU
// worker device. An accepted config is queried (parameter and Hugging Face names, shapes).
#include "fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fz::quiet_logs();
    fz::cpu_options();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz::set_input(data, size);
    std::string config(reinterpret_cast<const char *>(data), size);
    rp_model *model = nullptr;
    if (fz::check(rp_model_create_from_hf_config(&model, config.c_str(), fz::cpu_options()),
                  "rp_model_create_from_hf_config") != RP_OK) {
        if (model)
            fz::report("rp_model_create_from_hf_config", "failed but returned a model");
        return 0;
    }
    size_t count = 0;
    fz::check(rp_param_count(&count, model), "rp_param_count");
    for (size_t i = 0; i < count; ++i) {
        const char *name = nullptr, *hf = nullptr;
        int64_t shape[8];
        int32_t ndim = 0;
        fz::check(rp_param_name(&name, model, i), "rp_param_name");
        if (fz::check(rp_param_hf_name(&hf, model, i), "rp_param_hf_name") != RP_OK)
            fz::report("rp_param_hf_name", "fails on a model built from a config");
        fz::check(rp_param_shape(shape, &ndim, 8, model, i), "rp_param_shape");
    }
    rp_model_destroy(model);
    return 0;
}
