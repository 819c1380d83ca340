// When a weight upload kept from one call serves the next (src/engine/carried_weights.h): only
// for the same parameters, while each one's live tensor is the very tensor uploaded, and under
// the weights version the upload expected. Each case changes one of those from a matching
// record, so a rule that ignores any of them fails here.
#include <vector>

#include "engine/carried_weights.h"
#include "engine_check.h"

using engine_test::check;

int main() {
    const at::Tensor a = at::ones({4}), b = at::ones({2, 3});
    rp::CarriedWeights c;
    c.params = {3, 5};
    c.sources = {a, b};
    c.version = 7;
    c.transfer.tensors = {a.clone(), b.clone()};
    const std::vector<size_t> params = {3, 5};

    check(rp::carried_weights_match(c, params, {a, b}, 7), "the same tensors under the version");
    check(!rp::carried_weights_match(c, params, {a, b}, 6),
          "a publish expected and not made (the step's result not swapped in)");
    check(!rp::carried_weights_match(c, params, {a, b}, 8),
          "a publish or refresh beyond the one expected");
    check(!rp::carried_weights_match(c, params, {a, b.clone()}, 7),
          "equal values in another tensor (a different buffer is live)");
    check(!rp::carried_weights_match(c, {3}, {a}, 7), "fewer parameters");
    check(!rp::carried_weights_match(c, {5, 3}, {b, a}, 7), "the parameters in another order");
    check(!rp::carried_weights_match(c, {3, 6}, {a, b}, 7), "another parameter");
    check(!rp::carried_weights_match(c, params, {a}, 7), "live tensors missing");
    rp::CarriedWeights empty = c;
    empty.transfer.tensors.clear();
    check(!rp::carried_weights_match(empty, params, {a, b}, 7), "nothing uploaded");

    return engine_test::finish("carried weights");
}
