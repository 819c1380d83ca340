// libFuzzer target: rp_model_load of a fuzzed safetensors file into a small fixed model (the
// spec below; the seeds are checkpoints of it in several dtypes). A load that fails must leave
// the master weights bitwise unchanged.
#include "fuzz_common.h"

namespace {

const char *const kSpec = "{\"layers\": ["
                          "{\"type\": \"linear\", \"in\": 5, \"out\": 9},"
                          "{\"type\": \"layer_norm\", \"dim\": 9},"
                          "{\"type\": \"residual_mlp\", \"dim\": 9, \"hidden\": 13},"
                          "{\"type\": \"embedding\", \"num\": 7, \"dim\": 3},"
                          "{\"type\": \"linear\", \"in\": 3, \"out\": 2, \"bias\": false}]}";

rp_model *g_model = nullptr;
fz::Weights *g_weights = nullptr;

} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fz::quiet_logs();
    if (rp_model_create(&g_model, kSpec, fz::cpu_options()) != RP_OK)
        fz::failure("rp_model_create", rp_last_error_message());
    g_weights = new fz::Weights(fz::Weights::of(g_model));
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz::set_input(data, size);
    const fz::Scratch &scratch = fz::Scratch::get();
    scratch.clear();
    scratch.write("model.safetensors", data, size);
    std::string path = scratch.path("model.safetensors");
    bool ok = fz::check(rp_model_load(g_model, path.c_str()), "rp_model_load") == RP_OK;
    fz::Weights now = fz::Weights::of(g_model);
    if (!ok && !(now == *g_weights))
        fz::report("rp_model_load", "failed but changed the weights");
    *g_weights = std::move(now);
    return 0;
}
