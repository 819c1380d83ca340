// libFuzzer target: Hugging Face model directories. The input is a bundle of files, separated by
// the line "#rp-fuzz-file#":
//   part 0  config.json (empty: the tiny Qwen3 config below)
//   part 1  model.safetensors.index.json (empty: none)
//   part 2+ the weights: model.safetensors when there is no index, else the shards
//           model-00001-of-0000N.safetensors .. model-0000N-of-0000N.safetensors
// They are written to a scratch folder, then read twice: rp_model_create_from_hf (config and
// weights) and rp_model_load_hf into a fixed model built from the tiny config, whose weights must
// stay bitwise unchanged when the load fails. tests/fuzz/make_corpus.py writes the seeds.
#include "fuzz_common.h"

namespace {

const char *const kConfig =
    "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 16, \"hidden_size\": 8,"
    " \"intermediate_size\": 12, \"num_hidden_layers\": 1, \"num_attention_heads\": 2,"
    " \"num_key_value_heads\": 1, \"head_dim\": 4, \"tie_word_embeddings\": false,"
    " \"dtype\": \"float32\"}";
const std::string kSeparator = "#rp-fuzz-file#\n";

rp_model *g_model = nullptr;
fz::Weights *g_weights = nullptr;

std::vector<std::string> split(const std::string &bundle) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (;;) {
        size_t at = bundle.find(kSeparator, start);
        if (at == std::string::npos) {
            parts.push_back(bundle.substr(start));
            return parts;
        }
        parts.push_back(bundle.substr(start, at - start));
        start = at + kSeparator.size();
    }
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fz::quiet_logs();
    if (rp_model_create_from_hf_config(&g_model, kConfig, fz::cpu_options()) != RP_OK)
        fz::failure("rp_model_create_from_hf_config", rp_last_error_message());
    g_weights = new fz::Weights(fz::Weights::of(g_model));
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz::set_input(data, size);
    std::vector<std::string> parts = split(std::string(reinterpret_cast<const char *>(data), size));
    if (parts.size() > 10) // at most 8 shards
        return -1;         // not added to the corpus
    const fz::Scratch &scratch = fz::Scratch::get();
    scratch.clear();
    scratch.write("config.json", parts[0].empty() ? std::string(kConfig) : parts[0]);
    bool indexed = parts.size() > 1 && !parts[1].empty();
    if (indexed)
        scratch.write("model.safetensors.index.json", parts[1]);
    size_t shards = parts.size() > 2 ? parts.size() - 2 : 0;
    for (size_t i = 0; i < shards; ++i) {
        char name[64];
        if (indexed)
            std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, shards);
        else
            std::snprintf(name, sizeof name, i == 0 ? "model.safetensors" : "extra-%zu.safetensors",
                          i);
        scratch.write(name, parts[i + 2]);
    }

    rp_model *model = nullptr;
    if (fz::check(rp_model_create_from_hf(&model, scratch.dir().c_str(), fz::cpu_options()),
                  "rp_model_create_from_hf") == RP_OK)
        rp_model_destroy(model);
    else if (model)
        fz::report("rp_model_create_from_hf", "failed but returned a model");

    bool ok =
        fz::check(rp_model_load_hf(g_model, scratch.dir().c_str()), "rp_model_load_hf") == RP_OK;
    fz::Weights now = fz::Weights::of(g_model);
    if (!ok && !(now == *g_weights))
        fz::report("rp_model_load_hf", "failed but changed the weights");
    *g_weights = std::move(now);
    return 0;
}
