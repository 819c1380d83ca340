# RunConfig: upstream's RoundPipeRunConfig, and what a model resolves it to.

const _GRAINS = (stage=L.RP_GRAIN_STAGE, layer=L.RP_GRAIN_LAYER)

_split(s) = s === :replicate ? L.RP_SPLIT_REPLICATE : Int32(s)

"""
    RunConfig(; num_microbatch, recompute_grain, output_device, input_split, label_split,
              merge_output)

A run configuration (upstream's `RoundPipeRunConfig`); unset keywords stay unset, so the
model's configuration (or the built-in default) applies. `recompute_grain` is `:stage` or
`:layer`; `output_device` `:cpu` or a GPU index; `input_split` a `Dict(input index => dim or
:replicate)` (C dimensions, counted in C order); `label_split` a dim or `:replicate`;
`merge_output` a Bool. Read the fields back with `num_microbatch(c)`, `recompute_grain(c)`,
`output_device(c)` and `merge_output(c)` (`nothing` when unset); `resolve_run_config(model, c)`
says what a call would use.
"""
mutable struct RunConfig <: Handle
    ptr::Ptr{L.rp_run_config}

    # Owns `p`, from rp_run_config_create or rp_model_resolve_run_config.
    RunConfig(p::Ptr{L.rp_run_config}) = _own!(new(p))
end

function RunConfig(; num_microbatch=nothing, recompute_grain=nothing, output_device=nothing,
                   input_split=nothing, label_split=nothing, merge_output=nothing)
    _ensure_abi()
    _setup!(RunConfig(_create(L.rp_run_config, L.rp_run_config_create))) do c
        p = c.ptr
        num_microbatch === nothing ||
            @check L.rp_run_config_set_num_microbatch(p, Int32(num_microbatch))
        recompute_grain === nothing || @check L.rp_run_config_set_recompute_grain(p,
            _code(_GRAINS, recompute_grain, "recompute grain"))
        if output_device !== nothing
            kind, id = output_device === :cpu ? (L.kDLCPU, 0) : (L.kDLCUDA, Int(output_device))
            @check L.rp_run_config_set_output_device(p, Int32(kind), Int32(id))
        end
        if input_split !== nothing
            for (i, s) in input_split
                @check L.rp_run_config_set_input_split_dim(p, Int32(i), Int32(_split(s)))
            end
        end
        label_split === nothing ||
            @check L.rp_run_config_set_label_split_dim(p, Int32(_split(label_split)))
        merge_output === nothing ||
            @check L.rp_run_config_set_merge_output(p, Int32(merge_output ? 1 : 0))
    end
end

_cfg(c::Nothing) = Ptr{L.rp_run_config}(C_NULL)
_cfg(c::RunConfig) = _ptr(c)

"Number of microbatches `c` sets (`nothing`: unset)."
function num_microbatch(c::RunConfig)
    n = Ref{Int32}(0)
    @check L.rp_run_config_get_num_microbatch(n, _ptr(c))
    return n[] == 0 ? nothing : Int(n[])
end

"Recompute granularity `c` sets: `:stage`, `:layer` or `nothing` (unset)."
function recompute_grain(c::RunConfig)
    g = Ref{Int32}(0)
    @check L.rp_run_config_get_recompute_grain(g, _ptr(c))
    return g[] == L.RP_GRAIN_STAGE ? :stage : g[] == L.RP_GRAIN_LAYER ? :layer : nothing
end

"Output device `c` sets: `:cpu`, a GPU index, or `nothing` (unset)."
function output_device(c::RunConfig)
    kind, id = Ref{Int32}(0), Ref{Int32}(0)
    @check L.rp_run_config_get_output_device(kind, id, _ptr(c))
    return kind[] == L.kDLCPU ? :cpu : kind[] == L.kDLCUDA ? Int(id[]) : nothing
end

"Whether `c` merges the microbatches' outputs (`nothing`: unset)."
function merge_output(c::RunConfig)
    m = Ref{Int32}(-1)
    @check L.rp_run_config_get_merge_output(m, _ptr(c))
    return m[] < 0 ? nothing : m[] != 0
end
