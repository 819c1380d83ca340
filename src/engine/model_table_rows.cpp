// Deferred table rows: an in-call step splits the update of the model's lookup table (an
// embedding first layer's weight) in two (docs/semantics.md "Deferred table rows").
//
// Why: with in-call steps on a large model the optimizer is the slower side. It spends the start
// of each call finishing the previous step, shallowest parameters first, so the devices can
// upload each stage as soon as it is updated; then it has nothing to do until the tail's last
// microbatch makes the first gradient of this call final. An embedding's rows that no token of
// a call used have a zero gradient, but AdamW still moves them (momentum, weight decay), which
// costs as much per row as a used one: with random tokens about four fifths of the table. Those
// rows are exactly the work that may wait for that idle stretch, as long as nobody reads them
// first: the next call reads only the rows its tokens name, and it posts them (CallRows) as it
// starts, so the step updates those as soon as it sees them and opens the table to that call;
// every later reader (the call after, rp_forward, rp_synchronize, a save) waits for a later step
// or for the optimizer thread, so it finds the whole update. Each element gets bit for bit what
// the whole update gives it (BuiltinOptimizer::split_next_update), so the split changes when
// rows are updated, never what they become.
#include <cstdlib>
#include <string>

#include "engine/model.h"

namespace rp {

int64_t Model::find_lookup_table() const {
    if (layers_.empty() || !layers_[0]->looks_up_rows() || layers_[0]->takes_all_call_inputs())
        return -1;
    const std::vector<size_t> &own = store_.layer_params(0);
    if (own.size() != 1)
        return -1;
    const size_t table = own[0];
    if (!store_.at(table).trainable() || store_.at(table).master.dim() != 2)
        return -1;
    for (size_t l = 1; l < layers_.size(); ++l) // a tied LM head reads every row
        for (size_t pi : store_.layer_params(l))
            if (pi == table)
                return -1;
    return static_cast<int64_t>(table);
}

at::Tensor Model::table_rows_of(const Microbatches &mb) const {
    // The split needs the memory-saving AdamW with a bf16 weight copy (the row update's kernel),
    // and every row of the gradient coming from this rank's tokens (no data parallelism).
    if (lookup_table_ < 0 || !defer_table_rows_ || !in_call_ ||
        in_call_->kind != OptimizerKind::AdamW || !store_.saving() || dp_)
        return at::Tensor();
    const Param &table = store_.at(static_cast<size_t>(lookup_table_));
    if (table.live.scalar_type() != at::kBFloat16 || table.live.is_same(table.master))
        return at::Tensor();
    at::Tensor rows = at::zeros({table.master.size(0)}, at::kByte);
    for (const std::vector<at::Tensor> &inputs : mb.inputs) {
        // Integer token ids, checked against the table's rows on the host (check_index_ranges).
        const at::Tensor ids = inputs.at(0).to(at::kCPU, at::kLong).reshape({-1});
        rows.index_fill_(0, ids, 1);
    }
    return rows;
}

void Model::serve_next_call_rows(int64_t number, bool &served) {
    if (served || !builtin_->has_deferred_rows())
        return;
    const at::Tensor next = call_rows_.rows_of(number + 1);
    if (!next.defined())
        return;
    {
        HostSpan span(timeline_, "optimizer",
                      "in-call step " + std::to_string(number) + ": the next call's table rows");
        builtin_->serve_deferred_rows(next);
    }
    // Only the call that posted them can be waiting for this step's table now: every other
    // reader comes after it and waits for a later step (docs/semantics.md).
    gate_.open(static_cast<size_t>(lookup_table_), number);
    served = true;
}

} // namespace rp
