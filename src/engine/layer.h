// A pipeline layer: a pure function of its parameters and its input. Layers hold no tensors, so
// the engine decides where weights live (host store, device copies) and one layer object can
// run on every device at once.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace rp {

// Label value that marks a target to ignore (Hugging Face's and PyTorch's ignore_index).
constexpr int64_t kIgnoreLabel = -100;

enum class InitKind { Uniform, Normal, Ones, Zeros, Given };

// What a layer's tensor is. Only trainable parameters get an fp32 master, gradients and optimizer
// state; frozen parameters and buffers are held once, in their held dtype (the model dtype for
// floating ones), and lent to the layer like any parameter.
enum class ParamRole { Trainable, Frozen, Buffer };

struct ParamSpec {
    ParamSpec(std::string name_, std::vector<int64_t> shape_, InitKind init_ = InitKind::Zeros,
              double scale_ = 0.0, std::string tied_to_ = "")
        : name(std::move(name_)), shape(std::move(shape_)), init(init_), scale(scale_),
          tied_to(std::move(tied_to_)) {}

    std::string name;           // the layer's own name, e.g. "fc1.weight"
    std::vector<int64_t> shape; // fixed at construction
    InitKind init = InitKind::Zeros;
    double scale = 0.0; // uniform bound or normal standard deviation
    // Full name of an earlier layer's parameter this one shares (tied embeddings, e.g.
    // "0.weight"); empty for a parameter of its own. A shared parameter has one master weight and
    // its gradient is the sum over every use.
    std::string tied_to;
    ParamRole role = ParamRole::Trainable;
    // A tied parameter declared without a shape (caller-defined layers): it takes the shape of
    // the parameter it is tied to.
    bool shape_from_tie = false;
    // InitKind::Given: the initial value (host memory); its dtype decides the held dtype of a
    // non-floating frozen parameter or buffer.
    at::Tensor initial;
};

// Which pass over a layer a call is: a forward stage (no gradient), the recompute of a backward
// stage (gradient; buffers must not change), or the fused tail (forward with gradient, buffers
// updated, backward follows).
enum class Phase { Forward, Recompute, Tail };

// Per-call, per-microbatch facts a layer may need.
struct LayerContext {
    bool training = false;
    uint64_t dropout_seed = 0; // derived from (model seed, call, layer, microbatch)
    // The call's inputs 1.. for this microbatch (attention masks, position ids, ...), on the
    // compute device; never null during a call (empty when the call has one input).
    const std::vector<at::Tensor> *side_inputs = nullptr;
    // This microbatch's labels on the compute device, given only to the layers of the fused tail
    // stage of a training call whose loss a last layer may fuse (the causal-LM loss, or a loss
    // that is the output itself); null elsewhere.
    const at::Tensor *labels = nullptr;
    Phase phase = Phase::Forward;
    size_t microbatch = 0;
    size_t layer_index = 0;
    at::Device device = at::Device(at::kCPU); // where this layer computes
    size_t num_microbatches = 1; // of the call
    // An embedding may give its weight's gradient as a sparse COO tensor of the rows its tokens
    // used (at::embedding's `sparse`): the call's gradient path adds just those rows on the host
    // instead of downloading and adding the whole [vocab, dim] table. Set when the call's
    // accumulation takes such gradients (GradAccumulator::takes_row_gradients); see
    // embedding_row_gradient.
    bool row_gradients = false;
};

// Whether an embedding's lookup of `ids` in `weight` gives a row gradient: when the call takes
// them and the call's rows (this microbatch's times the microbatches) are no more than the
// table's, so the rows never cost more to move and add than the dense gradient (a small
// vocabulary over many tokens stays dense).
inline bool embedding_row_gradient(const LayerContext &lc, const at::Tensor &ids,
                                   const at::Tensor &weight) {
    return lc.row_gradients && weight.dim() == 2 &&
           ids.numel() * static_cast<int64_t>(lc.num_microbatches) <= weight.size(0);
}

class Layer {
  public:
    virtual ~Layer() = default;

    virtual std::string type() const = 0;
    const std::vector<ParamSpec> &params() const { return params_; }
    // Elements of the parameters this layer owns (tied ones are another layer's); -1 when a
    // shape from outside (a spec, a config) makes the count overflow an int64.
    int64_t own_param_elements() const { return count_elements(false, false); }
    // The same, of the trainable parameters only (`trainable`) or of the others (frozen
    // parameters and buffers, which cost only their held bytes).
    int64_t own_param_elements(bool trainable) const { return count_elements(true, trainable); }

  private:
    int64_t count_elements(bool filter, bool trainable) const {
        int64_t n = 0;
        for (const ParamSpec &spec : params_) {
            if (filter && (spec.role == ParamRole::Trainable) != trainable)
                continue;
            int64_t count = 1;
            for (int64_t d : spec.shape)
                if (d < 0 || __builtin_mul_overflow(count, d, &count))
                    return -1;
            if (spec.tied_to.empty() && __builtin_add_overflow(n, count, &n))
                return -1;
        }
        return n;
    }

  public:

    // `params` are in the order of params(), on the device and dtype of the computation.
    virtual at::Tensor forward(const std::vector<at::Tensor> &params, const at::Tensor &x,
                               const LayerContext &ctx) const = 0;

    // Activations between layers are lists of tensors. A built-in layer reads tensor 0 and
    // outputs one tensor; a caller-defined layer takes and gives any list.
    virtual std::vector<at::Tensor> forward_list(const std::vector<at::Tensor> &params,
                                                 const std::vector<at::Tensor> &inputs,
                                                 const LayerContext &ctx) const {
        return {forward(params, inputs.at(0), ctx)};
    }
    // As a first layer: whether it receives every input of the call (caller-defined layers) or
    // only input 0, the others reaching it as side inputs (built-in layers).
    virtual bool takes_all_call_inputs() const { return false; }
    // Whether the engine can run it on an empty batch to check shapes before a call (false for
    // caller-defined layers: their code is not ours to probe).
    virtual bool shape_checkable() const { return true; }
    // Relative cost for the planner before any measurement: parameters dominate both compute
    // and transfer time for the layers we build, plus a constant for parameter-free layers.
    virtual double cost_estimate() const;

    // Device memory a training pass needs beyond weights, gradients and activations (e.g. the
    // fp32 gradient accumulator of a chunked loss), in bytes; counted in the stage's budget.
    // A layer that can trade memory for speed reports what it chose within its grant.
    virtual double workspace_bytes() const { return 0.0; }
    // The model's grant, made once when the model is created (before any call, never during
    // one): the device memory this layer's workspace may use, in bytes (infinity where devices
    // have no cap, e.g. CPU devices), and the dtype the layer will compute in. A layer whose
    // workspace can shrink (the loss chunk of the LM head) sizes it to fit.
    virtual void grant_workspace(double bytes, at::ScalarType compute_dtype) {
        (void)bytes;
        (void)compute_dtype;
    }

    // Device bytes a forward with gradients keeps for backward, per token of the microbatch (a
    // token: each element of an integer input 0, each row along the last dimension of a
    // floating one; Model::tokens_per_microbatch), for activations of `dtype_bytes` bytes per
    // element. The planner multiplies it by the tokens of the microbatch in flight to size the
    // fused tail and the recompute working sets under the GPU memory cap.
    // < 0: unknown; the planner takes the figure of the layer before (a parameter-free layer
    // keeps about what its neighbour does). The default guesses from the parameters: a layer
    // keeps at least the input of each of its matrix products (a matrix's last dimension), and
    // four times that covers the intermediates around them (the decoder layer, counted
    // exactly, keeps 3.4 times); a layer with only vectors (a norm) four times their width.
    virtual double activation_bytes_per_token(double dtype_bytes) const {
        double inputs = 0, widest_vector = 0;
        for (const ParamSpec &spec : params_) {
            if (spec.shape.size() >= 2)
                inputs += static_cast<double>(spec.shape.back());
            else if (spec.shape.size() == 1)
                widest_vector = std::max(widest_vector, static_cast<double>(spec.shape[0]));
        }
        if (inputs == 0 && widest_vector == 0)
            return -1.0;
        return 4.0 * dtype_bytes * (inputs > 0 ? inputs : widest_vector);
    }

    // Integer values of its input that this layer uses as row indices must lie in
    // [0, input_index_limit()); 0: the layer indexes nothing. Asked of a model's first layer, so
    // bad token ids fail on the host before a GPU could index out of bounds (a device-side
    // assertion would poison the whole process).
    virtual int64_t input_index_limit() const { return 0; }
    // A lookup table: its one parameter, [rows, width], is read only at the rows its integer
    // input names (those input_index_limit bounds), so its gradient is zero on every other row.
    // Lets an in-call step defer the update of the rows a call did not use (Model's deferred
    // table rows), when the table is the first layer's and no other layer shares it.
    virtual bool looks_up_rows() const { return false; }
    // Integer labels of a loss this layer fuses must lie in [0, label_index_limit()) or be
    // kIgnoreLabel; 0: the layer fuses no such loss. Asked of a model's last layer.
    virtual int64_t label_index_limit() const { return 0; }

    // Marks every trainable parameter this layer declares frozen (a LoRA model trains only its
    // adapters); the layer's computation is unchanged.
    void freeze_params() {
        for (ParamSpec &spec : params_)
            if (spec.role == ParamRole::Trainable)
                spec.role = ParamRole::Frozen;
    }

    // Initial values given by the caller are copied into the parameter store; the layer need not
    // keep a second copy.
    void drop_initial_values() {
        for (ParamSpec &spec : params_)
            spec.initial = at::Tensor();
    }

  protected:
    std::vector<ParamSpec> params_;
};

} // namespace rp
