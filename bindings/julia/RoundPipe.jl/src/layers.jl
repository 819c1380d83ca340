# Caller-defined layers: a layer whose forward and backward are Julia functions, mixed with
# built-in layers in one model (`Model(spec, layers)`). RoundPipe owns the layer's parameters
# and buffers (master weights, gradients, optimizer state, save and load) and lends them to the
# functions for each call through a `LayerCall`. The functions run on library threads; their
# trampolines are in callbacks.jl.

const _PHASES = Dict(L.RP_PHASE_FORWARD => :forward, L.RP_PHASE_RECOMPUTE => :recompute,
                     L.RP_PHASE_TAIL => :tail)

"""
    LayerCall

What one call of a layer function is lent, valid during the call only: `phase` (`:forward`, a
forward stage without gradient; `:recompute`, the recompute of a backward stage; `:tail`, the
fused last stage), `device_type` / `device_id`, `seed` (the same in a forward and its
recompute), `microbatch`, `training`. `layer_params(call)` and `layer_buffers(call)` give
copies of the layer's tensors; `with_buffer(f, call, i)` a writable view of buffer `i`.
"""
struct LayerCall
    ptr::Ptr{L.rp_layer_call}
    phase::Symbol
    device_type::Int
    device_id::Int
    seed::UInt64
    microbatch::Int
    training::Bool
end

function LayerCall(p::Ptr{L.rp_layer_call})
    phase, dt, di, mb, tr = Ref{Int32}(0), Ref{Int32}(0), Ref{Int32}(0), Ref{Int32}(0),
                            Ref{Int32}(0)
    seed = Ref{UInt64}(0)
    @check L.rp_layer_call_info(phase, dt, di, Ptr{Ptr{Cvoid}}(C_NULL), seed, mb, tr, p)
    return LayerCall(p, _PHASES[phase[]], Int(dt[]), Int(di[]), seed[], Int(mb[]), tr[] != 0)
end

# The lent DLPack pointers of the parameters (buffers=false) or buffers of a call.
function _call_tensors(c::LayerCall, buffers::Bool)
    pp, np = Ref{Ptr{Ptr{L.DLManagedTensor}}}(C_NULL), Ref{Csize_t}(0)
    bp, nb = Ref{Ptr{Ptr{L.DLManagedTensor}}}(C_NULL), Ref{Csize_t}(0)
    @check L.rp_layer_call_tensors(pp, np, bp, nb, c.ptr)
    arr, n = buffers ? (bp[], nb[]) : (pp[], np[])
    return Ptr{L.DLManagedTensor}[unsafe_load(arr, i) for i in 1:Int(n)]
end

"Copies of the layer's parameters, in declaration order (dimensions reversed, as everywhere)."
layer_params(c::LayerCall) = Array[_to_array(p; delete=false) for p in _call_tensors(c, false)]

"Copies of the layer's buffers, in declaration order."
layer_buffers(c::LayerCall) = Array[_to_array(p; delete=false) for p in _call_tensors(c, true)]

"""
    with_buffer(f, call, i)

Call `f(b)` with a zero-copy array over buffer `i` (from 1), to update it in place; refused in
the `:recompute` phase, where buffers must not change. `b` must not be used after `f` returns.
"""
function with_buffer(f, c::LayerCall, i::Integer)
    c.phase === :recompute && _invalid("buffers must not change in the recompute phase")
    ps = _call_tensors(c, true)
    1 <= i <= length(ps) || _invalid("the layer has $(length(ps)) buffers, not $i")
    return f(_wrap(ps[i]))
end

"""
    LayerDef(forward, backward=nothing; name="julia:layer")

A caller-defined layer. `forward(call::LayerCall, inputs...) -> (outputs, context)`: `inputs`
are copies of the layer's input arrays; `outputs` a tuple (or vector) of arrays, at least one;
`context` anything `backward` needs, kept only in the phases with gradient (`:recompute`,
`:tail`; return `nothing` in `:forward`). `backward(call, context, output_grads) ->
(input_grads, param_grads)`: `output_grads` has one array (or `nothing`) per output; the
results have one entry per input and one per parameter in declaration order, each an array of
that tensor's size or `nothing` (always `nothing` for a frozen parameter). `backward` may be
`nothing` for a layer that passes no gradient.

Declare the layer's tensors with `add_param!` and `add_buffer!`, then build a model with
`Model(spec, [layer, ...])`, where `{"type": "caller", "def": i}` in the spec is the layer at
index `i - 1` of the vector (the spec counts from 0). The functions run on library threads; an
exception fails the call with `RP_ERR_CALLBACK`, and the `RoundPipeError` message includes it.
"""
mutable struct LayerDef <: Handle
    ptr::Ptr{L.rp_layer_def}
    name::String
    forward::Any
    backward::Any
    last_error::Union{Nothing,String}
    # Contexts kept between a forward with gradient and its backward, by the key the engine
    # holds; kept here so the garbage collector sees them. Callbacks of different devices may
    # run at once: the lock guards the table.
    contexts::Dict{UInt,Any}
    next_key::UInt
    lock::ReentrantLock

    LayerDef(name::String, forward, backward) =
        _own!(new(Ptr{L.rp_layer_def}(C_NULL), name, forward, backward, nothing,
                  Dict{UInt,Any}(), UInt(0), ReentrantLock()))
end

# `forward::Function` (not Any): more specific than every handle's do-block form
# `(::Type{T})(f::Function, args...)`, which would otherwise make the call ambiguous.
function LayerDef(forward::Function, backward::Union{Nothing,Function}=nothing;
                  name::AbstractString="julia:layer")
    _ensure_abi()
    d = LayerDef(String(name), forward, backward)
    bw = backward === nothing ? C_NULL : _LAYER_BACKWARD_TRAMPOLINE[]
    # user_data is the LayerDef itself; every model built from it keeps it reachable.
    d.ptr = _create(L.rp_layer_def, L.rp_layer_def_create, d.name, _LAYER_FORWARD_TRAMPOLINE[],
                    bw, _LAYER_RELEASE_TRAMPOLINE[], pointer_from_objref(d))
    return d
end

"""
    add_param!(layer, name, initial; trainable=true) -> layer

Declare a parameter whose shape and value are `initial`'s (copied now; dimensions reversed for
the library, as for inputs). Trainable parameters get gradients and optimizer updates (they must
be floating); `trainable=false` freezes it: no gradient, no optimizer state, no update.
"""
function add_param!(d::LayerDef, name::AbstractString, initial::AbstractArray;
                    trainable::Bool=true)
    _with_borrowed_one(initial) do tp
        @check L.rp_layer_def_add_param(_ptr(d), String(name), tp, Int32(trainable))
    end
    return d
end

"Declare a buffer (state that is not trained, updated in `:forward` and `:tail`), copied from `initial`."
function add_buffer!(d::LayerDef, name::AbstractString, initial::AbstractArray)
    _with_borrowed_one(initial) do tp
        @check L.rp_layer_def_add_buffer(_ptr(d), String(name), tp)
    end
    return d
end

"Relative cost of the layer for the stage planner."
function set_cost!(d::LayerDef, cost::Real)
    @check L.rp_layer_def_set_cost(_ptr(d), Float64(cost))
    return d
end

"Device bytes per token the layer keeps for backward (model dtype); sizes stages under a cap."
function set_activation_bytes!(d::LayerDef, bytes_per_token::Real)
    @check L.rp_layer_def_set_activation_bytes(_ptr(d), Float64(bytes_per_token))
    return d
end

# Contexts: stored under a nonzero key, which is what the engine holds as the C context.
function _keep_context!(d::LayerDef, ctx)
    lock(d.lock) do
        d.next_key += 1
        d.contexts[d.next_key] = ctx
        return Ptr{Cvoid}(d.next_key)
    end
end

_context(d::LayerDef, p::Ptr{Cvoid}) = lock(() -> d.contexts[UInt(p)], d.lock)

_release_context!(d::LayerDef, p::Ptr{Cvoid}) =
    lock(() -> (delete!(d.contexts, UInt(p)); nothing), d.lock)

const _PARAM_KINDS = Dict(L.RP_PARAM_TRAINABLE => :trainable, L.RP_PARAM_FROZEN => :frozen,
                          L.RP_PARAM_BUFFER => :buffer)

"""
    param_kind(model, i) -> Symbol

What parameter `i` is: `:trainable`, `:frozen` or `:buffer` (the last two exist only in
caller-defined layers; they have no gradient and no optimizer state).
"""
function param_kind(m::Model, i::Integer)
    k = Ref{Int32}(0)
    @check L.rp_param_kind_of(k, _ptr(m), Csize_t(i - 1))
    return _PARAM_KINDS[k[]]
end

function Model(spec::AbstractString, layers::AbstractVector{<:LayerDef}; options...)
    _ensure_abi()
    defs = Ptr{L.rp_layer_def}[_ptr(d) for d in layers]
    p = _with_options(; options...) do opts
        GC.@preserve defs _create(L.rp_model, L.rp_model_create_with_layers, String(spec),
                                  defs, Csize_t(length(defs)), opts)
    end
    m = Model(p)
    append!(m.layers, layers)  # their functions are the model's callbacks' user_data
    return m
end

# A failed call's error, with the messages of the model's layer functions that failed.
function _layer_details(m::Model, e::RoundPipeError)
    e.status == L.RP_ERR_CALLBACK || return e
    msgs = String[]
    for d in m.layers
        d.last_error === nothing || push!(msgs, d.last_error)
        d.last_error = nothing
    end
    isempty(msgs) && return e
    return RoundPipeError(e.status, e.message * ": " * join(msgs, "; "))
end

_clear_layer_errors!(m::Model) = foreach(d -> (d.last_error = nothing), m.layers)
